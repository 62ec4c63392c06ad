"""``hvd.join()`` with Horovod's semantics: joined ranks serve the others' allreduces and optimizer steps."""

from __future__ import annotations

from typing import Any

import pytest

import phalanx

pytestmark = [pytest.mark.multiprocess]


def _expected(n: int, step: int, base: Any) -> dict[str, Any]:
    """Rank r runs steps 0..r-1, contributing (r + 1) * base: in ``step`` ranks step+1..n-1 are live."""
    live = [r + 1 for r in range(step + 1, n)]
    total = sum(live)
    return {"sum": base * total, "avg": base * total / n, "min": base * min(live), "max": base * max(live)}


def _allreduces(hvd: Any, x: Any) -> dict[str, Any]:
    h = hvd.allreduce_async(x, op=hvd.Sum)
    inplace = x.clone()
    hvd.allreduce_(inplace, op=hvd.Max)
    return {"sum": hvd.synchronize(h), "avg": hvd.allreduce(x), "min": hvd.allreduce(x, op=hvd.Min), "max": inplace}


def _step(hvd: Any, n: int, me: int, step: int, tensors: tuple[Any, Any], fail: list[str]) -> None:
    """One step of a live rank while ranks 0..step have joined."""
    import torch

    small, big = tensors
    predicted = hvd.allreduce(big * (me + 1))  # step 0: the speculative payload, zeros from the joined
    if not torch.allclose(predicted, _expected(n, step, big)["avg"]):
        fail.append(f"step {step} predicted average: {predicted[:3].tolist()}")
    for label, base in (("inline", small), ("payload", big)):
        got = _allreduces(hvd, base * (me + 1))
        for op, want in _expected(n, step, base).items():
            if not torch.allclose(got[op], want):
                fail.append(f"step {step} {label} {op}: {got[op][:3].tolist()} != {want[:3].tolist()}")
    try:
        hvd.allgather(small)
        fail.append(f"step {step}: allgather with a joined rank did not raise")
    except RuntimeError as e:
        if "called hvd.join()" not in str(e) or "rank(s) [0" not in str(e):
            fail.append(f"step {step}: unclear error {e}")


def _collectives_job() -> list[str]:
    import torch

    import phalanx.torch as hvd

    hvd.init()
    n, me = hvd.size(), hvd.rank()
    fail: list[str] = []
    small, big = torch.arange(1.0, 6.0), torch.full((40_000,), 0.5)
    for _ in range(10):  # every rank: the big allreduce is predicted (speculative payload) from now on
        hvd.allreduce(big)
    for step in range(me):  # rank r runs r steps, then joins
        _step(hvd, n, me, step, (small, big), fail)
    last = hvd.join()
    if last != n - 1:
        fail.append(f"join returned {last}, expected {n - 1}")
    if hvd.allreduce(torch.ones(3), op=hvd.Sum).tolist() != [float(n)] * 3:
        fail.append("allreduce after join")
    if hvd.join() not in range(n):
        fail.append("second join")
    hvd.shutdown()
    return fail


def _batch(step: int, rank: int, features: int = 4) -> Any:
    import torch

    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(8, features, generator=g), torch.randn(8, 2 if features == 4 else 160, generator=g)


def _optimizer_job(features: int = 4) -> dict[str, Any]:
    import torch

    import phalanx.torch as hvd

    hvd.init()
    n, me = hvd.size(), hvd.rank()
    torch.manual_seed(0)
    # features=128: 82 KB of gradients, reduced in place from .grad (the joined rank serves one zero buffer)
    width = 2 if features == 4 else 160
    model, ref = torch.nn.Linear(features, width), torch.nn.Linear(features, width)
    ref.load_state_dict(model.state_dict())
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters())
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for step in range(2 + me):  # uneven: rank r has 2 + r batches
        x, y = _batch(step, me, features)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        ref_opt.zero_grad()  # the reference: the live ranks' gradients summed, divided by the full size
        for r in range(max(0, step - 1), n):
            if step < 2 + r:
                xr, yr = _batch(step, r, features)
                (torch.nn.functional.mse_loss(ref(xr), yr) / n).backward()
        ref_opt.step()
    last = hvd.join()
    same = all(torch.allclose(a, b, atol=1e-6) for a, b in zip(model.parameters(), ref.parameters()))
    hvd.broadcast_parameters(model.state_dict(), root_rank=last)
    final = [p.detach().clone() for p in model.parameters()]
    hvd.shutdown()
    return {"last": last, "same as reference": same, "final": [t.tolist() for t in final]}


@pytest.mark.timeout(180)
@pytest.mark.parametrize("np", [2, 3])
def test_joined_ranks_serve_allreduces_and_refuse_other_collectives(np: int) -> None:
    assert phalanx.run(_collectives_job, np=np) == [[]] * np


@pytest.mark.timeout(180)
@pytest.mark.parametrize(("np", "shm"), [(2, "1"), (3, "1"), (2, "0"), (2, "async"), (3, "wide")])
def test_distributed_optimizer_with_uneven_batches_and_join(np: int, shm: str) -> None:
    # async: the live ranks' buckets (one per parameter) wait on the worker thread until the joined rank
    # has seen the step's control block and serves them.
    env = {"PHALANX_SHM": "1", "PHALANX_SHM_GRAD_ASYNC": "1", "HOROVOD_FUSION_THRESHOLD": "0"} if shm == "async" \
        else {"PHALANX_SHM": "1" if shm == "wide" else shm}
    reports = phalanx.run(_optimizer_job, args=(128 if shm == "wide" else 4,), np=np, env=env)
    assert [r["last"] for r in reports] == [np - 1] * np
    assert all(r["same as reference"] for r in reports), reports
    assert all(r["final"] == reports[-1]["final"] for r in reports)
