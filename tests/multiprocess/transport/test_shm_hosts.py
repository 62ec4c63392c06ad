"""The ``phalanx_shm`` torch backend on multi-host jobs (hosts simulated with ``HOROVOD_HOSTNAME`` per rank):
hierarchical collectives (shared memory within a host, gloo among the hosts' leaders) agree with gloo and a
local reference; DDP gives gloo's weights; a rank that dies makes the others fail with a clear error; the
automatic substitution picks it when some host has two ranks and keeps gloo otherwise or when switched off.
"""

from __future__ import annotations

import functools
import os
from typing import Any

import pytest

import phalanx
from phalanx.errors import WorkerFailedError

pytestmark = [pytest.mark.multiprocess]

AABB = ["hostA", "hostA", "hostB", "hostB"]
SIZES = [0, 1, 7, 1001, 70001]  # 0, 1, odd, one small step, several 4 KiB slots / cross-memory attach
SLOT = {"PHALANX_SHM_SLOT_BYTES": "4096", "PHALANX_SHM_TIMEOUT_S": "60"}


def _leftovers() -> list[str]:
    return sorted(n for n in os.listdir("/dev/shm") if n.startswith("phalanx-shm-"))


def _as_host(hosts: list[str]) -> None:
    """Pretend to run on ``hosts[RANK]``, with the variables a launcher sets for that layout."""
    rank = int(os.environ["RANK"])
    os.environ["HOROVOD_HOSTNAME"] = hosts[rank]
    os.environ["LOCAL_WORLD_SIZE"] = str(hosts.count(hosts[rank]))
    os.environ["GROUP_WORLD_SIZE"] = str(len(set(hosts)))


def _value(rank: int, dtype: Any, n: int) -> Any:
    import torch

    g = torch.Generator().manual_seed(31 * rank + n)
    vals = torch.randint(1, 3, (n,), generator=g)
    if dtype == torch.bool:
        return vals > 1
    return torch.complex(vals.float(), -vals.float()).to(dtype) if dtype.is_complex else vals.to(dtype)


def _reference(size: int, dtype: Any, n: int, op: Any) -> Any:
    """Every rank's values reduced locally, in rank order (exact: small integers)."""
    import torch
    import torch.distributed as dist

    R = dist.ReduceOp
    fns = {R.SUM: torch.add, R.AVG: torch.add, R.PRODUCT: torch.mul, R.MIN: torch.minimum, R.MAX: torch.maximum,
           R.BAND: torch.bitwise_and, R.BOR: torch.bitwise_or, R.BXOR: torch.bitwise_xor}
    out = functools.reduce(fns[op], [_value(r, dtype, n) for r in range(size)])
    if op == R.AVG and dtype.is_complex:
        return torch.view_as_complex(torch.view_as_real(out) / size)  # per component, as gloo divides
    return out / size if op == R.AVG else out


def _attempt(fn: Any) -> Any:
    try:
        return fn()
    except (RuntimeError, ValueError) as e:  # an op gloo refuses (torch checks some before any backend)
        return f"error: {str(e)[:60]}"


def _same(got: Any, want: Any) -> bool:
    import torch

    if isinstance(got, str) or isinstance(want, str):
        return isinstance(got, str) and isinstance(want, str)
    return bool(got.dtype == want.dtype and torch.equal(got, want))


def _allreduce_checks(gloo: Any) -> list[str]:
    """Every dtype x op x size: phalanx_shm (default group) vs gloo vs the local reference; what gloo refuses
    is refused alike or (int16, which gloo lacks) reduced right."""
    import torch
    import torch.distributed as dist

    R, r, size, bad = dist.ReduceOp, dist.get_rank(), dist.get_world_size(), []
    dtypes = [torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.float16, torch.bfloat16,
              torch.float32, torch.float64, torch.bool, torch.complex64]
    for dtype in dtypes:
        for op in (R.SUM, R.AVG, R.PRODUCT, R.MIN, R.MAX, R.BAND, R.BOR, R.BXOR):
            for n in SIZES:
                shm, plain = _value(r, dtype, n), _value(r, dtype, n)
                a = _attempt(lambda: dist.all_reduce(shm, op=op) or shm)  # noqa: B023
                b = _attempt(lambda: dist.all_reduce(plain, op=op, group=gloo) or plain)  # noqa: B023
                want = _reference(size, dtype, n, op) if not isinstance(b, str) else b
                if isinstance(b, str) and not isinstance(a, str):  # gloo has no int16: shm reduces it anyway
                    b = want = _reference(size, dtype, n, op)
                if not (_same(a, b) and _same(a, want)):
                    bad.append(f"all_reduce {dtype} {op} n={n}: shm {str(a)[:50]} gloo {str(b)[:50]}")
    return bad


def _other_checks() -> list[str]:
    """broadcast from every root, barrier, all_gather_into_tensor, reduce_scatter_tensor (SUM, AVG)."""
    import torch
    import torch.distributed as dist

    r, size, bad = dist.get_rank(), dist.get_world_size(), []
    for root in range(size):
        for n in (0, 5, 3001):
            t = torch.full((n,), float(r + 10), dtype=torch.float64)
            dist.broadcast(t, src=root)
            if not torch.equal(t, torch.full((n,), float(root + 10), dtype=torch.float64)):
                bad.append(f"broadcast root={root} n={n}: {t[:3].tolist()}")
    dist.barrier()
    for n in (1, 7, 2501):
        want = torch.cat([torch.arange(n, dtype=torch.int32) + 1000 * q for q in range(size)])
        out = torch.empty(size * n, dtype=torch.int32)
        dist.all_gather_into_tensor(out, torch.arange(n, dtype=torch.int32) + 1000 * r)
        inplace = torch.full((size * n,), -1, dtype=torch.int32)  # FSDP2's way: the input is out's own part
        inplace[r * n : (r + 1) * n] = torch.arange(n, dtype=torch.int32) + 1000 * r
        dist.all_gather_into_tensor(inplace, inplace[r * n : (r + 1) * n])
        if not torch.equal(out, want) or not torch.equal(inplace, want):
            bad.append(f"all_gather_into_tensor n={n}")
    return bad + _reduce_scatter_checks()


def _reduce_scatter_checks() -> list[str]:
    """reduce_scatter_tensor SUM / AVG / MAX of float32 and int64, parts small and above the cross-memory size."""
    import torch
    import torch.distributed as dist

    r, size, bad = dist.get_rank(), dist.get_world_size(), []
    total = sum(q + 1 for q in range(size))
    cases = ((dist.ReduceOp.SUM, torch.float32, total), (dist.ReduceOp.AVG, torch.float32, total / size),
             (dist.ReduceOp.MAX, torch.int64, size), (dist.ReduceOp.SUM, torch.int64, total))
    for n in (3, 20001):
        for op, dtype, factor in cases:
            part = torch.empty(n, dtype=dtype)
            dist.reduce_scatter_tensor(part, (torch.arange(n * size) * (r + 1)).to(dtype), op=op)
            want = (torch.arange(n * r, n * r + n) * factor).to(dtype)
            if not torch.allclose(part, want):
                bad.append(f"reduce_scatter_tensor {op} {dtype} n={n}: {part[:4].tolist()} != {want[:4].tolist()}")
    return bad


def _ops_job(hosts: list[str]) -> list[str]:
    import torch.distributed as dist

    # white-box: the cross-host parts and copies, counted inside the transport (no public name)
    from phalanx.transport import _hier, _ops, backend

    _hier.PART_BYTES = 4096  # the part-by-part crossing (allreduce, reduce-scatter) for every cross-memory size
    parts, inner = [], _ops.allreduce_cma_
    _ops.allreduce_cma_ = lambda *a: parts.append(1) or inner(*a)  # type: ignore[assignment]

    _as_host(hosts)
    dist.init_process_group(backend.NAME)
    pg = dist.distributed_c10d._get_default_group()
    gloo = dist.new_group(backend="gloo")
    bad = [] if pg.hier is not None and pg.hier.multi else [f"not hierarchical: {pg.hier}"]
    if (pg.hier.cross is not None) != (hosts == AABB):  # part-wise across hosts when hosts are alike
        bad.append(f"cross group {pg.hier.cross} for hosts {hosts}")
    bad += _allreduce_checks(gloo) + _other_checks()
    if bool(parts) != (hosts == AABB and pg.hier.ch.cma):
        bad.append(f"{len(parts)} allreduces crossed hosts part by part on hosts {hosts}")
    kinds = ("allreduce", "broadcast", "barrier", "allgather", "reduce_scatter")
    if any(pg.shm_calls[k] == 0 for k in kinds):
        bad.append(f"not through shared memory: {dict(pg.shm_calls)}")
    if (pg.shm_calls["reduce_scatter_hosts"] > 0) != (hosts == AABB):  # hierarchical when hosts are alike
        bad.append(f"reduce-scatter paths on hosts {hosts}: {dict(pg.shm_calls)}")
    dist.destroy_process_group()
    return bad


@pytest.mark.timeout(240)
@pytest.mark.parametrize(("hosts", "env"), [(AABB, SLOT), (AABB, {**SLOT, "PHALANX_SHM_CMA": "0"}),
                                            (["hostA", "hostB", "hostA"], SLOT)], ids=["AABB", "AABB-no-CMA", "ABA"])
def test_hierarchical_collectives_match_gloo(hosts: list[str], env: dict[str, str]) -> None:
    assert phalanx.run(_ops_job, args=(hosts,), np=len(hosts), env=env) == [[]] * len(hosts)
    assert _leftovers() == []


def _train_alike(models: list[Any], steps: int, batch: tuple[int, int]) -> None:
    """Train each model with SGD on the same per-rank random batches (seeded by rank), one after the other."""
    import torch
    import torch.distributed as dist

    for model in models:
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        torch.manual_seed(1 + dist.get_rank())
        for _ in range(steps):
            opt.zero_grad()
            model(torch.randn(*batch)).pow(2).sum().backward()
            opt.step()


def _ddp_job(hosts: list[str]) -> tuple[str, bool, bool, float]:
    """DDP on the default group (a plain "gloo" request, substituted) and on a gloo group, same seeds and
    data: (backend, gradients through shared memory, ranks agree bitwise, max weight difference to gloo)."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    _as_host(hosts)
    dist.init_process_group("gloo")
    pg = dist.distributed_c10d._get_default_group()
    gloo = dist.new_group(backend="gloo")
    models = []
    for group in (pg, gloo):
        torch.manual_seed(0)
        net = torch.nn.Sequential(torch.nn.Linear(60, 30), torch.nn.ReLU(), torch.nn.Linear(30, 3))
        models.append(DDP(net, process_group=group))
    _train_alike(models, steps=4, batch=(8, 60))
    flat = [torch.cat([p.detach().reshape(-1) for p in m.parameters()]) for m in models]
    every = [torch.empty_like(flat[0]) for _ in range(dist.get_world_size())]
    dist.all_gather(every, flat[0])
    calls = getattr(pg, "shm_calls", None) or {}
    backend = f"{dist.get_backend()} {dist.get_backend_config()}"
    out = (backend, calls.get("allreduce", 0) >= 4, all(torch.equal(every[0], e) for e in every),
           float((flat[0] - flat[1]).abs().max()))
    dist.destroy_process_group()
    return out


@pytest.mark.timeout(120)
def test_ddp_on_two_hosts_gets_gloos_weights() -> None:
    for backend, used, agree, diff in phalanx.run(_ddp_job, args=(AABB,), np=4):
        assert (backend, used, agree) == ("gloo cpu:phalanx_shm,cuda:gloo", True, True)
        assert diff < 1e-5  # the same weights up to the order of the float sums
    assert _leftovers() == []


@pytest.mark.timeout(120)
@pytest.mark.parametrize("hosts, env", [(["hostA", "hostB"], {}), (AABB, {"PHALANX_SHM_NATIVE": "0"}),
                                        (AABB, {"PHALANX_SHM": "0"})], ids=["AB", "native-off", "shm-off"])
def test_gloo_is_kept(hosts: list[str], env: dict[str, str]) -> None:
    """One rank per host (nothing to share) and the switches keep the plain gloo default group."""
    for backend, used, agree, diff in phalanx.run(_ddp_job, args=(hosts,), np=len(hosts), env=env):
        assert (backend, used, agree, diff) == ("gloo cpu:gloo,cuda:gloo", False, True, 0.0)


def _peer_leaves(hosts: list[str], n: int) -> str:
    import torch
    import torch.distributed as dist

    # white-box: the cross-host parts and copies, counted inside the transport (no public name)
    from phalanx.transport import _hier, backend

    _hier.PART_BYTES = 4096  # 400 KB crosses part by part
    _as_host(hosts)
    dist.init_process_group(backend.NAME)
    dist.all_reduce(torch.ones(10))
    if dist.get_rank() == 3:
        return "left"  # host B's second rank, without the collective the others are waiting in
    try:
        dist.all_reduce(torch.ones(n))
    except RuntimeError as e:  # ShmTransportError, raised by the Work's wait
        return f"{type(e).__name__}: {e}"
    return "all_reduce returned"


@pytest.mark.timeout(90)
@pytest.mark.parametrize("n", [5000, 100_000], ids=["through-leaders", "part-wise"])
def test_a_rank_that_is_gone_makes_every_other_raise(n: int) -> None:
    """Host B's leader sees its peer die; host A's leader sees B's leader go (gloo); A's other rank sees
    its leader give up. Each fails in the check that every rank issued the same call (an all-gather of the
    calls, which crosses hosts through the leaders), before the allreduce's own data moves, whatever its size."""
    a0, a1, b0, b1 = phalanx.run(_peer_leaves, args=(AABB, n), np=4, env={"PHALANX_SHM_TIMEOUT_S": "60"})
    assert b1 == "left"
    assert b0.startswith("ShmTransportError: shared-memory allreduce") and "has died" in b0
    assert a0.startswith("ShmTransportError: shared-memory allreduce") and "across hosts" in a0, a0
    assert a1.startswith("ShmTransportError: shared-memory allreduce") and (
        "gave up" in a1 or "across hosts" in a1), a1
    assert _leftovers() == []


def _killed_in_ddp(hosts: list[str]) -> None:
    from test_shm_auto import _die_in_ddp  # same directory: DDP with rank 1 SIGKILLed at step 3

    _as_host(hosts)
    _die_in_ddp()


@pytest.mark.timeout(90)
def test_no_leftovers_when_a_rank_is_killed_mid_ddp() -> None:
    with pytest.raises(WorkerFailedError, match="SIGKILL"):
        phalanx.run(_killed_in_ddp, args=(AABB,), np=4, env={"PHALANX_SHM_TIMEOUT_S": "20"})
    assert _leftovers() == []


def _attach_fails(hosts: list[str]) -> tuple[bool, list[float]]:
    import torch
    import torch.distributed as dist

    # white-box: the segment a rank attached, inside the transport (no public name)
    from phalanx.transport import _segment, backend

    def refuse(name: str, nbytes: int) -> Any:
        raise OSError(f"no room to map {name}")

    if int(os.environ["RANK"]) == 3:
        _segment.attach = refuse  # type: ignore[assignment]  # host B's second rank cannot map its segment
    _as_host(hosts)
    dist.init_process_group(backend.NAME)
    pg = dist.distributed_c10d._get_default_group()
    t = torch.full((3,), float(dist.get_rank()))
    dist.all_reduce(t)
    out = (pg.hier is None, t.tolist())
    dist.destroy_process_group()
    return out


@pytest.mark.timeout(60)
def test_a_host_that_cannot_set_up_shared_memory_makes_the_group_plain_gloo() -> None:
    assert phalanx.run(_attach_fails, args=(AABB,), np=4) == [(True, [6.0] * 3)] * 4
    assert _leftovers() == []


def _fsdp2_job(hosts: list[str]) -> tuple[bool, float]:
    """FSDP2 (``fully_shard``) on the substituted default group and on a gloo group, same seeds and data:
    (all-gathers and reduce-scatters went through the hierarchy, max difference of the local shards)."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    _as_host(hosts)
    dist.init_process_group("gloo")
    pg = dist.distributed_c10d._get_default_group()
    models = []
    for group in (pg, dist.new_group(backend="gloo")):
        torch.manual_seed(0)
        net = torch.nn.Sequential(torch.nn.Linear(33, 17), torch.nn.ReLU(), torch.nn.Linear(17, 5))
        mesh = DeviceMesh.from_group(group, "cpu")
        for layer in (net[0], net[2]):
            fully_shard(layer, mesh=mesh)
        models.append(fully_shard(net, mesh=mesh))
    _train_alike(models, steps=3, batch=(6, 33))
    shards = [torch.cat([p.detach().to_local().reshape(-1) for p in m.parameters()]) for m in models]
    calls = getattr(pg, "shm_calls", {})
    used = calls.get("allgather", 0) > 0 and calls.get("reduce_scatter", 0) > 0
    diff = float((shards[0] - shards[1]).abs().max())
    dist.destroy_process_group()
    return used, diff


@pytest.mark.timeout(120)
def test_fsdp2_on_two_hosts_gets_gloos_weights() -> None:
    for used, diff in phalanx.run(_fsdp2_job, args=(AABB,), np=4):
        assert used and diff < 1e-5, (used, diff)
    assert _leftovers() == []
