"""DDP on the experimental ``phalanx_shm`` torch.distributed backend (shared memory + gloo for the rest)."""

from __future__ import annotations

import os
from typing import Any

import pytest

import phalanx

pytestmark = [pytest.mark.multiprocess]


def _gather_scatter(pg: Any, r: int) -> list[str]:
    """all_gather_into_tensor and reduce_scatter_tensor (SUM, AVG) through the group's shared memory."""
    import torch
    import torch.distributed as dist

    bad = []
    out = torch.empty(4, dtype=torch.int64)
    dist.all_gather_into_tensor(out, torch.tensor([r, r], dtype=torch.int64))
    if out.tolist() != [0, 0, 1, 1]:
        bad.append(f"all_gather_into_tensor: {out.tolist()}")
    part = torch.empty(3, dtype=torch.float64)
    dist.reduce_scatter_tensor(part, torch.arange(6, dtype=torch.float64) * (r + 1))
    if part.tolist() != [3.0 * v for v in range(3 * r, 3 * r + 3)]:
        bad.append(f"reduce_scatter_tensor: {part.tolist()}")
    dist.reduce_scatter_tensor(part, torch.arange(6, dtype=torch.float64) * (r + 1), op=dist.ReduceOp.AVG)
    if part.tolist() != [1.5 * v for v in range(3 * r, 3 * r + 3)]:
        bad.append(f"reduce_scatter_tensor AVG: {part.tolist()}")
    if pg.shm_calls["allgather"] != 1 or pg.shm_calls["reduce_scatter"] != 2:
        bad.append(f"all-gather / reduce-scatter not through shared memory: {pg.shm_calls}")
    return bad + _large_reduce_scatter(pg, r)


def _large_reduce_scatter(pg: Any, r: int) -> list[str]:
    """Above 64 KiB each rank sums its part straight from the peer's input (cross-memory reads): SUM, AVG and
    MAX over odd sizes and several dtypes, against the local reference; the input is left untouched."""
    import torch
    import torch.distributed as dist

    bad, R = [], dist.ReduceOp
    for dtype, n, op in [(torch.float32, 100_003, R.SUM), (torch.float64, 300_001, R.AVG),
                         (torch.int64, 70_001, R.MAX), (torch.bfloat16, 333_333, R.SUM)]:
        def make(rank: int, n: int = n, dtype: Any = dtype) -> Any:
            return (torch.arange(2 * n, dtype=torch.int64) % 7 * (rank + 1)).to(dtype)

        inp, part = make(r), torch.empty(n, dtype=dtype)
        dist.reduce_scatter_tensor(part, inp, op=op)
        full = torch.maximum(make(0), make(1)) if op == R.MAX else make(0) + make(1)
        want = (full / 2 if op == R.AVG else full)[r * n : (r + 1) * n]
        if not torch.equal(part, want) or not torch.equal(inp, make(r)):
            bad.append(f"reduce_scatter_tensor {dtype} n={n} {op}: {part[:4].tolist()} != {want[:4].tolist()}")
    if pg.hier.ch.cma and pg.shm_calls["reduce_scatter_direct"] != 4:
        bad.append(f"large reduce-scatters did not read the peers' inputs directly: {pg.shm_calls}")
    return bad


def _ddp_job() -> list[str]:
    import torch
    import torch.distributed as dist

    from phalanx.transport import backend

    dist.init_process_group(backend.NAME)
    r, bad = dist.get_rank(), []
    pg = dist.distributed_c10d._get_default_group()
    for dtype in (torch.float32, torch.float64, torch.int32, torch.bfloat16):
        for n in (0, 1, 1001, 600_001):
            t = torch.full((n,), r + 1, dtype=dtype)
            dist.all_reduce(t)
            if not torch.equal(t, torch.full((n,), 3, dtype=dtype)):
                bad.append(f"all_reduce {dtype} n={n}")
    torch.manual_seed(r)
    net = torch.nn.Sequential(torch.nn.Linear(100, 50), torch.nn.Linear(50, 2))
    model = torch.nn.parallel.DistributedDataParallel(net)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    before = pg.shm_calls["allreduce"]
    for _ in range(5):
        opt.zero_grad()
        model(torch.randn(8, 100)).sum().backward()
        opt.step()
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    gathered = [torch.empty_like(flat) for _ in range(2)]
    dist.all_gather(gathered, flat)
    if not torch.equal(gathered[0], gathered[1]):
        bad.append("DDP parameters diverged")
    if not isinstance(pg, backend.ShmProcessGroup) or pg.shm_calls["allreduce"] - before < 5:
        bad.append(f"DDP's allreduces did not go through shared memory: {getattr(pg, 'shm_calls', None)}")
    bad += _gather_scatter(pg, r)
    dist.barrier()
    dist.destroy_process_group()
    return bad


@pytest.mark.timeout(90)
def test_ddp_on_the_shm_backend() -> None:
    assert phalanx.run(_ddp_job, np=2) == [[], []]
    assert sorted(n for n in os.listdir("/dev/shm") if n.startswith("phalanx-shm-")) == []
