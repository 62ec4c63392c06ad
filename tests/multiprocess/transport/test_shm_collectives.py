"""phalanx.torch over the shared-memory transport: dtypes x ops x sizes, other kinds, the optimizer, the
hierarchical path (two simulated hosts) and the switch. Each test is one ``phalanx.run`` job.
"""

from __future__ import annotations

import os
from typing import Any

import pytest

import phalanx

pytestmark = [pytest.mark.multiprocess]

# 0, 1, odd, inline (<= 8 KiB), several chunks of the small slot the jobs use (4 KiB + remainder)
SIZES = [0, 1, 7, 1001, 4099, 70001]
SLOT = {"PHALANX_SHM_SLOT_BYTES": "4096", "PHALANX_SHM_TIMEOUT_S": "60"}


def _leftovers() -> list[str]:
    return sorted(n for n in os.listdir("/dev/shm") if n.startswith("phalanx-shm-"))


def _value(rank: int, dtype: Any, n: int) -> Any:
    import torch

    g = torch.Generator().manual_seed(97 * rank + n)
    vals = torch.randint(1, 3, (n,), generator=g)
    return (vals > 1) if dtype == torch.bool else vals.to(dtype)


def _expected(size: int, dtype: Any, n: int, op: int) -> Any:
    import torch

    import phalanx.torch as hvd

    stack = torch.stack([_value(r, dtype, n).double() for r in range(size)])
    if dtype == torch.bool:
        return (stack.amax(0) if op in (hvd.Sum, hvd.Max) else stack.amin(0)).bool()
    red = {hvd.Sum: stack.sum(0), hvd.Average: stack.sum(0) / size, hvd.Min: stack.amin(0),
           hvd.Max: stack.amax(0), hvd.Product: stack.prod(0)}[op]
    if not dtype.is_floating_point and op == hvd.Average:
        red = torch.floor(red)
    return red.to(dtype)


def _allreduce_checks(hosts: list[str] | None = None, cma: bool = True) -> list[str]:
    import torch

    import phalanx.torch as hvd

    # white-box: which route a group's collectives took: internal (no public name)
    from phalanx.transport import _dispatch

    if hosts is not None:
        os.environ["HOROVOD_HOSTNAME"] = hosts[int(os.environ["RANK"])]
    hvd.init()
    bad = [] if _dispatch._ROUTES else [f"rank {hvd.rank()}: no shared-memory route"]
    for transport, _kind in _dispatch._ROUTES.values():
        if any(ch.cma != cma for ch in transport.channels.values()):
            bad.append(f"rank {hvd.rank()}: cross-memory attach should be {'on' if cma else 'off'}")
    dtypes = [torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.float16, torch.bfloat16,
              torch.float32, torch.float64, torch.bool]
    for dtype in dtypes:
        for op in (hvd.Sum, hvd.Average, hvd.Min, hvd.Max, hvd.Product):
            if dtype == torch.bool and op == hvd.Average:
                continue
            for n in SIZES:
                got = hvd.allreduce(_value(hvd.rank(), dtype, n), op=op)
                want = _expected(hvd.size(), dtype, n, op)
                if not torch.equal(got, want):
                    bad.append(f"allreduce {dtype} op={op} n={n}: {got[:4].tolist()} != {want[:4].tolist()}")
    hvd.shutdown()
    return bad


def _other_checks(hosts: list[str] | None = None) -> list[str]:
    import torch

    import phalanx.torch as hvd

    # white-box: counts the hierarchical (cross-host) calls: internal (no public name)
    from phalanx.transport import _hier

    calls = {"allgather_": 0, "broadcast_": 0}
    for name in calls:  # count the hierarchical calls across hosts (control blocks are allgathers; small
        # broadcasts travel inside them)
        orig = getattr(_hier.Hierarchy, name)

        def counted(self: Any, *a: Any, _orig: Any = orig, _name: str = name) -> None:
            calls[_name] += 1
            _orig(self, *a)

        setattr(_hier.Hierarchy, name, counted)
    if hosts is not None:
        os.environ["HOROVOD_HOSTNAME"] = hosts[int(os.environ["RANK"])]
    hvd.init()
    r, bad = hvd.rank(), []
    for n in SIZES:
        src = torch.arange(n, dtype=torch.float64) * (r + 1)
        got = hvd.broadcast(src, root_rank=1)
        if not torch.equal(got, torch.arange(n, dtype=torch.float64) * 2):
            bad.append(f"broadcast n={n}")
        g = hvd.allgather(torch.full((r + 1, n), r, dtype=torch.int16))
        want = torch.cat([torch.full((i + 1, n), i, dtype=torch.int16) for i in range(hvd.size())])
        if not torch.equal(g, want):
            bad.append(f"allgather n={n}")
        rs = hvd.reducescatter(torch.ones(n + 2, 3), op=hvd.Sum)
        if not torch.equal(rs, torch.full_like(rs, float(hvd.size()))):
            bad.append(f"reducescatter n={n}")
    x = torch.arange(12.0).reshape(3, 4).t()  # not contiguous
    if not torch.equal(hvd.allreduce(x, op=hvd.Sum), hvd.size() * x):
        bad.append("non-contiguous allreduce")
    hvd.barrier()
    bad += _optimizer_checks()
    if hosts is not None and (calls["allgather_"] < len(SIZES) or not calls["broadcast_"]):
        bad.append(f"rank {r}: hierarchical calls across hosts {calls}")
    hvd.shutdown()
    return bad


def _optimizer_checks() -> list[str]:
    import torch

    import phalanx.torch as hvd

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(33, 17), torch.nn.ReLU(), torch.nn.Linear(17, 3))
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters())
    for step in range(5):
        torch.manual_seed(step * 10 + hvd.rank())
        opt.zero_grad()
        model(torch.randn(8, 33)).sum().backward()
        opt.step()
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    gathered = hvd.allgather(flat.unsqueeze(0))
    return [] if torch.equal(gathered[0], gathered[-1]) else ["optimizer: parameters diverged across ranks"]


@pytest.mark.timeout(150)
def test_allreduce_every_dtype_op_size() -> None:
    results = phalanx.run(_allreduce_checks, np=2, env=SLOT)
    assert results == [[], []]
    assert _leftovers() == []


@pytest.mark.timeout(150)
def test_allreduce_through_the_segment_without_cma() -> None:
    """``PHALANX_SHM_CMA=0`` on one rank: every rank copies large allreduces through the segment."""
    env = {**SLOT, "PHALANX_SHM_CMA": "0"}
    assert phalanx.run(_allreduce_checks, args=(None, False), np=2, env=env) == [[], []]
    assert _leftovers() == []


@pytest.mark.timeout(120)
def test_broadcast_allgather_reducescatter_optimizer() -> None:
    assert phalanx.run(_other_checks, np=2, env=SLOT) == [[], []]
    assert _leftovers() == []


@pytest.mark.timeout(150)
@pytest.mark.parametrize("hosts", ["ABA", "AABB"])
def test_broadcast_allgather_control_blocks_across_hosts(hosts: str) -> None:
    """Broadcast from rank 1, allgather, reducescatter, the optimizer, and every control block, hierarchical
    (shared memory within a host, gloo between the hosts' leaders), agree with the reference. ABA allgathers
    by a bitwise-or allreduce, AABB host block by host block."""
    names = [f"host{h}" for h in hosts]
    assert phalanx.run(_other_checks, args=(names,), np=len(names), env=SLOT) == [[]] * len(names)
    assert _leftovers() == []


def _large_allreduce_checks(hosts: list[str]) -> list[str]:
    """Tensors of at least ``PART_BYTES`` across hosts with as many ranks each: every rank carries its part
    across hosts, pipelined in pieces (bool and int16 reach the transport as bytes and int32), with exact
    results."""
    import torch

    import phalanx.torch as hvd

    # white-box: counts the hierarchical (cross-host) calls: internal (no public name)
    from phalanx.transport import _hier

    paths = {"pipelined": 0}
    orig = _hier.Hierarchy._allreduce_pipelined

    def counted(self: Any, *a: Any) -> None:
        paths["pipelined"] += 1
        orig(self, *a)

    _hier.Hierarchy._allreduce_pipelined = counted  # type: ignore[method-assign]
    os.environ["HOROVOD_HOSTNAME"] = hosts[int(os.environ["RANK"])]
    hvd.init()
    bad, n, calls = [], LARGE, 0
    dtypes = [torch.uint8, torch.int16, torch.float16, torch.bfloat16, torch.float32, torch.bool]
    for dtype in dtypes:
        for op in (hvd.Sum, hvd.Average, hvd.Max, hvd.Product):
            if dtype == torch.bool and op == hvd.Average:
                continue
            got = hvd.allreduce(_value(hvd.rank(), dtype, n), op=op)
            calls += 1
            want = _expected(hvd.size(), dtype, n, op)
            if not torch.equal(got, want):
                wrong = int((got != want).sum())
                bad.append(f"allreduce {dtype} op={op} n={n}: {wrong} elements differ")
    if paths["pipelined"] != calls:
        bad.append(f"rank {hvd.rank()}: {paths['pipelined']} pipelined crossings of {calls} allreduces")
    hvd.shutdown()
    return bad


# Above the part-by-part threshold (2 MiB) in every dtype, odd, and several pieces of a crossing per part.
LARGE = 2_200_003


@pytest.mark.timeout(150)
def test_large_allreduces_cross_hosts_part_by_part() -> None:
    hosts = ["hostA", "hostA", "hostB", "hostB"]
    assert phalanx.run(_large_allreduce_checks, args=(hosts,), np=4, env=SLOT) == [[]] * 4
    assert _leftovers() == []


@pytest.mark.timeout(150)
def test_hierarchical_two_hosts() -> None:
    hosts = ["hostA", "hostA", "hostA", "hostB"]  # 3 ranks in shm on A, 1 alone on B
    assert phalanx.run(_allreduce_checks, args=(hosts,), np=4, env=SLOT) == [[]] * 4
    assert _leftovers() == []


def _switch_off() -> bool:
    import torch

    import phalanx.torch as hvd

    # white-box: which route a group's collectives took: internal (no public name)
    from phalanx.transport import _dispatch

    hvd.init()
    ok = not _dispatch._ROUTES and torch.equal(hvd.allreduce(torch.ones(3), op=hvd.Sum), torch.full((3,), 2.0))
    hvd.shutdown()
    return ok


@pytest.mark.timeout(60)
def test_switch_off_uses_gloo() -> None:
    assert phalanx.run(_switch_off, np=2, env={"PHALANX_SHM": "0"}) == [True, True]
