"""DistributedOptimizer against a single-process reference on the same global batch."""

from __future__ import annotations

from typing import Any

import pytest

import phalanx

pytestmark = [pytest.mark.multiprocess]


def _model(seed: int = 0, width: int = 32) -> Any:
    import torch

    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(8, width), torch.nn.ReLU(), torch.nn.Linear(width, width), torch.nn.Tanh(),
        torch.nn.Linear(width, 3),
    )


def _batches(steps: int, per_rank: int, n: int) -> list[tuple[Any, Any]]:
    import torch

    g = torch.Generator().manual_seed(42)
    return [(torch.randn(per_rank * n, 8, generator=g), torch.randn(per_rank * n, 3, generator=g))
            for _ in range(steps)]


def _train(opt_factory: Any, wrap: Any, n: int, me: int, steps: int = 3, bpps: int = 1, width: int = 32,
           set_to_none: bool = True) -> Any:
    """Train on this rank's shard (or the whole batch when n == 1 and me == 0); return the weights."""
    import torch

    model = _model(width=width)
    opt = wrap(opt_factory(model.parameters()), model)
    per = 4
    for x, y in _batches(steps, per * bpps, n):
        xs, ys = x.view(n, per * bpps, 8)[me], y.view(n, per * bpps, 3)[me]
        for k in range(bpps):
            xk, yk = xs[k * per : (k + 1) * per], ys[k * per : (k + 1) * per]
            loss = torch.nn.functional.mse_loss(model(xk), yk) / bpps
            loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=set_to_none)
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def _sgd(params: Any) -> Any:
    import torch

    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def _adam(params: Any) -> Any:
    import torch

    return torch.optim.Adam(params, lr=0.01)


def _reference(opt_factory: Any, n: int, bpps: int = 1, width: int = 32) -> Any:
    """One process on the whole global batch: the same arithmetic as averaging n shard gradients."""
    import torch

    model = _model(width=width)
    opt = opt_factory(model.parameters())
    for x, y in _batches(3, 4 * bpps, n):
        shards = list(zip(x.view(n, 4 * bpps, 8), y.view(n, 4 * bpps, 3)))
        for xs, ys in shards:
            for k in range(bpps):
                xk, yk = xs[k * 4 : (k + 1) * 4], ys[k * 4 : (k + 1) * 4]
                (torch.nn.functional.mse_loss(model(xk), yk) / bpps / n).backward()
        opt.step()
        opt.zero_grad()
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def _check_equivalence(fail: list[str], n: int, me: int) -> None:
    import torch

    import phalanx.torch as hvd

    variants: dict[str, Any] = {
        "default": lambda o, m: hvd.DistributedOptimizer(o, named_parameters=m.named_parameters()),
        "no names": lambda o, m: hvd.DistributedOptimizer(o),
        "num_groups": lambda o, m: hvd.DistributedOptimizer(o, m.named_parameters(), num_groups=2),
        "groups": lambda o, m: hvd.DistributedOptimizer(o, m.named_parameters(), groups=[list(m.parameters())[:2]]),
        "predivide": lambda o, m: hvd.DistributedOptimizer(o, m.named_parameters(), gradient_predivide_factor=2.0),
        "fp16": lambda o, m: hvd.DistributedOptimizer(o, m.named_parameters(), compression=hvd.Compression.fp16),
    }
    for factory in (_sgd, _adam):
        want = _reference(factory, n)
        for name, wrap in variants.items():
            got = _train(factory, wrap, n, me)
            tol = 2e-2 if name == "fp16" else 1e-5
            if not torch.allclose(got, want, atol=tol, rtol=tol):
                fail.append(f"{factory.__name__} {name}: max diff {float((got - want).abs().max())}")
    want = _reference(_sgd, n, bpps=2)
    got = _train(_sgd, lambda o, m: hvd.DistributedOptimizer(o, m.named_parameters(), backward_passes_per_step=2),
                 n, me, bpps=2)
    if not torch.allclose(got, want, atol=1e-5):
        fail.append(f"backward_passes_per_step=2: max diff {float((got - want).abs().max())}")
    summed = _train(_sgd, lambda o, m: hvd.DistributedOptimizer(o, m.named_parameters(), op=hvd.Sum), n, me)
    if not torch.allclose(summed, hvd.broadcast(summed, 0)):
        fail.append("op=Sum: ranks diverged")


class _Branchy:
    """A model whose second branch is used only on rank 0; rank 1 runs its layers in another order."""

    def __init__(self, width: int = 4) -> None:
        import torch

        torch.manual_seed(1)
        self.a, self.b, self.c = torch.nn.Linear(4, width), torch.nn.Linear(width, width), torch.nn.Linear(width, 1)

    def params(self) -> list[Any]:
        return [*self.a.parameters(), *self.b.parameters(), *self.c.parameters()]

    def named(self) -> list[tuple[str, Any]]:
        return [(f"{m}.{k}", p) for m in "abc" for k, p in getattr(self, m).named_parameters()]

    def loss(self, x: Any, me: int) -> Any:
        if me == 0:
            return self.c(self.b(self.a(x))).sum()
        return self.c(self.a(x)).sum()  # b unused on rank 1


def _check_unused_and_order(fail: list[str], me: int, width: int = 4) -> None:
    import torch

    import phalanx.torch as hvd

    net = _Branchy(width)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(net.params(), lr=0.0), named_parameters=net.named())
    for _ in range(2):
        net.loss(torch.ones(2, 4), me).backward()
        # An explicit collective between backward and step (a metric), while rank 1 still holds back the
        # bucket of its unused parameter: it must not interleave with the gradient buckets.
        if hvd.allreduce(torch.ones(40_000), op=hvd.Sum)[0].item() != 2.0:
            fail.append("metric allreduce between backward and step")
        opt.step()
        grads = [p.grad.clone() for p in net.params()]
        opt.zero_grad()
    every = hvd.allgather_object(grads)
    if not all(torch.equal(g0, g1) for g0, g1 in zip(every[0], every[1])):
        fail.append("unused parameters: ranks ended with different gradients")
    try:
        net.loss(torch.ones(2, 4), me).backward()
        opt.zero_grad()
        fail.append("zero_grad between backward and step accepted")
    except ValueError:
        opt.step()


def _check_skip_synchronize(fail: list[str], n: int, me: int) -> None:
    import torch

    import phalanx.torch as hvd

    model = _model()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters())
    model(torch.ones(2, 8) * (me + 1)).sum().backward()
    opt.synchronize()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
    with opt.skip_synchronize():
        opt.step()
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    if not torch.equal(flat, hvd.broadcast(flat, 0)):
        fail.append("skip_synchronize: ranks diverged")
    try:
        model(torch.ones(2, 8)).sum().backward()
        model(torch.ones(2, 8)).sum().backward()
        fail.append("two backward passes with backward_passes_per_step=1 accepted")
    except ValueError:
        opt.synchronize()


def _optimizer_job() -> list[str]:
    import phalanx.torch as hvd

    hvd.init()
    n, me = hvd.size(), hvd.rank()
    fail: list[str] = []
    _check_equivalence(fail, n, me)
    if n == 2:
        _check_unused_and_order(fail, me)
    _check_skip_synchronize(fail, n, me)
    hvd.shutdown()
    return fail


@pytest.mark.timeout(180)
@pytest.mark.parametrize(("threshold", "grad_async"), [("1024", "0"), ("", "0"), ("1024", "1")])
def test_distributed_optimizer_matches_the_single_process_reference(threshold: str, grad_async: str) -> None:
    # 1 KiB: many buckets (hooks fire in different orders across ranks); "": the 128 MiB default.
    # grad_async: the buckets are reduced on the shared-memory worker thread while backward runs.
    env = {"HOROVOD_FUSION_THRESHOLD": threshold, "PHALANX_SHM_GRAD_ASYNC": grad_async}
    assert phalanx.run(_optimizer_job, np=2, env=env) == [[], []]


@pytest.mark.timeout(120)
def test_distributed_optimizer_at_three_ranks() -> None:
    assert phalanx.run(_optimizer_job, np=3, env={"HOROVOD_FUSION_THRESHOLD": "4096"}) == [[], [], []]


def _goes_on_smaller() -> Any:
    import os
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    import phalanx.torch as hvd

    hvd.init()
    w = torch.nn.Parameter(torch.zeros(4))
    opt = hvd.DistributedOptimizer(torch.optim.SGD([w], lr=1.0), named_parameters=[("w", w)])

    def step() -> list[float]:
        (w * float(hvd.rank() + 1)).sum().backward()  # rank r's gradient: r + 1
        opt.step()
        opt.zero_grad()
        return [float(v) for v in w.detach()]

    first, me = step(), hvd.rank()
    hvd.shutdown()
    if me == 2:
        return None
    # A re-formed world of two (what an elastic job that goes on smaller does): a fresh group, hvd.init().
    from phalanx.job import store_client

    store = store_client.from_env(os.environ, timedelta(seconds=30))  # the job's authenticated store
    dist.init_process_group("gloo", store=dist.PrefixStore("smaller", store), rank=me, world_size=2)
    hvd.init()
    second, size = step(), hvd.size()
    hvd.shutdown()
    dist.destroy_process_group()
    return first, second, size


@pytest.mark.timeout(90)
def test_the_averaging_divisor_follows_the_world_after_a_re_formation() -> None:
    out = phalanx.run(_goes_on_smaller, np=3)
    assert out[2] is None
    for first, second, size in out[:2]:
        assert size == 2
        assert first == [-2.0] * 4  # (1 + 2 + 3) / 3
        assert second == [-3.5] * 4  # then (1 + 2) / 2, not / 3


WIDE = 128  # 18k parameters: 72 KB of gradients, above the slot exchange's 64 KiB (reduced in place with CMA)


def _in_place_job(pack_on: int) -> list[str]:
    """The wide model's gradients reduced straight from ``.grad`` (no fusion buffer), checked against the
    reference; rank ``pack_on`` fuses into the buffer instead (ranks that took different paths must meet)."""
    import torch

    import phalanx.torch as hvd

    # white-box: which path a bucket took (packed or from .grad) and its route: internal (no public name)
    from phalanx.torch._train import buckets as _buckets
    from phalanx.torch.process_sets import global_process_set, groups_of
    from phalanx.transport import _dispatch

    hvd.init()
    n, me = hvd.size(), hvd.rank()
    route = _dispatch._ROUTES.get(id(groups_of(global_process_set).grad.group))
    expect_pack = me == pack_on or route is None or not route[0].channels["grad"].cma  # no CMA: every rank packs
    if me == pack_on:
        _buckets.DIRECT_DTYPES = ()  # type: ignore[misc]  # this rank packs: its table has one segment
    packed: list[int] = []
    pack = _buckets.pack
    _buckets.pack = lambda bucket, prescale: (packed.append(1), pack(bucket, prescale))[1]  # type: ignore[assignment]
    fail: list[str] = []
    wrap = {
        "default": lambda o, m: hvd.DistributedOptimizer(o, named_parameters=m.named_parameters()),
        "predivide": lambda o, m: hvd.DistributedOptimizer(o, m.named_parameters(), gradient_predivide_factor=2.0),
        "two buckets": lambda o, m: hvd.DistributedOptimizer(o, m.named_parameters(), num_groups=2),
    }
    for factory in (_sgd, _adam):
        want = _reference(factory, n, width=WIDE)
        for name, w in wrap.items():
            for set_to_none in (True, False):
                packed.clear()
                got = _train(factory, w, n, me, width=WIDE, set_to_none=set_to_none)
                if name == "default" and bool(packed) != expect_pack:  # "two buckets": one is too small
                    fail.append(f"rank {me} packed {len(packed)} buckets (expected to pack: {expect_pack})")
                if not torch.allclose(got, want, atol=1e-5, rtol=1e-5):
                    diff = float((got - want).abs().max())
                    fail.append(f"{factory.__name__} {name} set_to_none={set_to_none}: max diff {diff}")
    want = _reference(_sgd, n, bpps=2, width=WIDE)
    got = _train(_sgd, lambda o, m: hvd.DistributedOptimizer(o, m.named_parameters(), backward_passes_per_step=2),
                 n, me, bpps=2, width=WIDE)
    if not torch.allclose(got, want, atol=1e-5):
        fail.append(f"backward_passes_per_step=2: max diff {float((got - want).abs().max())}")
    summed = _train(_sgd, lambda o, m: hvd.DistributedOptimizer(o, m.named_parameters(), op=hvd.Sum), n, me,
                    width=WIDE)
    if not torch.equal(summed, hvd.broadcast(summed, 0)):
        fail.append("op=Sum: ranks diverged")
    if n == 2:
        _check_unused_and_order(fail, me, width=WIDE)
    hvd.shutdown()
    return fail


@pytest.mark.timeout(180)
@pytest.mark.parametrize(("np", "pack_on"), [(2, -1), (2, 1), (3, 0)])
def test_gradients_reduced_in_place_match_the_reference(np: int, pack_on: int) -> None:
    assert phalanx.run(_in_place_job, args=(pack_on,), np=np) == [[]] * np


# a 1024 x 1024 layer: 4 MB of gradient, whole 2 MiB blocks advised for huge pages (transport/_huge_pages.py)
HUGE = 1024


def _huge_pages_job() -> tuple[list[str], bool, int]:
    """The gradients the peer reads by cross-memory attach go to huge pages; the result matches the reference."""
    import torch

    import phalanx.torch as hvd
    from phalanx.torch.process_sets import global_process_set, groups_of

    # white-box: the grad route's memory advice: internal (no public name)
    from phalanx.transport import _dispatch, _huge_pages

    hvd.init()
    n, me = hvd.size(), hvd.rank()
    route = _dispatch._ROUTES.get(id(groups_of(global_process_set).grad.group))
    cma = route is not None and route[0].channels["grad"].cma
    want = _reference(_sgd, n, width=HUGE)
    got = _train(_sgd, lambda o, m: hvd.DistributedOptimizer(o, named_parameters=m.named_parameters()), n, me,
                 width=HUGE)
    fail = [] if torch.allclose(got, want, atol=1e-5, rtol=1e-5) else [f"max diff {float((got - want).abs().max())}"]
    hvd.shutdown()
    return fail, cma, len(_huge_pages.ADVISOR.seen) + len(_huge_pages.ADVISOR.sighted)  # blocks offered for huge pages


@pytest.mark.timeout(120)
@pytest.mark.parametrize("thp", ["1", "0"])
def test_gradients_advised_to_huge_pages_match_the_reference(thp: str) -> None:
    out = phalanx.run(_huge_pages_job, np=2, env={"PHALANX_SHM_THP": thp})
    assert [fail for fail, _cross_memory, _blocks in out] == [[], []]
    for _fail, cma, blocks in out:
        assert (blocks >= 2) if cma and thp == "1" else blocks == 0, (cma, thp, blocks)
