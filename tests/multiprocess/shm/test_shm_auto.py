"""torch-native code under phalanx gets the shared-memory backend without code changes when it opts in
(``PHALANX_SHM_NATIVE=1``): a plain ``init_process_group("gloo")`` (DDP, FSDP2, Lightning) on a one-host job
becomes ``phalanx_shm``; by default it stays gloo."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import pytest

import phalanx

pytestmark = [pytest.mark.multiprocess]

NATIVE = {"PHALANX_SHM_NATIVE": "1"}
EXAMPLES = str(Path(__file__).resolve().parents[3] / "examples")


def _leftovers() -> list[str]:
    return sorted(n for n in os.listdir("/dev/shm") if n.startswith("phalanx-shm-"))


def _spy() -> dict[str, Any]:
    """Record what the (already wrapped) ``init_process_group`` really built."""
    import torch.distributed as dist

    seen: dict[str, Any] = {}
    inner = dist.init_process_group

    def spy(*args: Any, **kwargs: Any) -> Any:
        out = inner(*args, **kwargs)
        pg = dist.distributed_c10d._get_default_group()
        seen["backend"] = str(dist.get_backend())
        seen["calls"] = getattr(pg, "shm_calls", None)  # not the group: it must die with destroy
        return out

    dist.init_process_group = spy  # type: ignore[assignment]
    return seen


def _used_shm(seen: dict[str, Any], kinds: tuple[str, ...] = ("allreduce",)) -> bool:
    """Whether gradient collectives (not only DDP's initial broadcast) went through shared memory."""
    calls = seen.get("calls")
    return calls is not None and all(calls[k] > 0 for k in kinds)


def _ddp() -> tuple[str, bool, bool]:
    import torch
    import torch.distributed as dist

    seen = _spy()
    dist.init_process_group("gloo")
    torch.manual_seed(dist.get_rank())
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(40, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(3):
        opt.zero_grad()
        model(torch.randn(8, 40)).sum().backward()
        opt.step()
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    both = [torch.empty_like(flat) for _ in range(2)]
    dist.all_gather(both, flat)
    dist.destroy_process_group()
    return seen["backend"], _used_shm(seen), torch.equal(both[0], both[1])


@pytest.mark.timeout(90)
def test_ddp_on_gloo_request_gets_shared_memory() -> None:
    for backend, used, same in phalanx.run(_ddp, np=2, env=NATIVE):
        assert (backend, used, same) == ("phalanx_shm", True, True)
    assert _leftovers() == []


@pytest.mark.timeout(90)
def test_default_and_switch_off_keep_gloo() -> None:
    for env in ({}, {**NATIVE, "PHALANX_SHM": "0"}):
        for backend, used, same in phalanx.run(_ddp, np=2, env=env):
            assert (backend, used, same) == ("gloo", False, True)


def _example(name: str, fn: str, kinds: tuple[str, ...] = ("allreduce",)) -> tuple[str, bool, float]:
    sys.path.insert(0, EXAMPLES)
    module = __import__(name)
    seen = _spy()
    accuracy = float(getattr(module, fn)(epochs=1))
    return seen["backend"], _used_shm(seen, kinds), accuracy


@pytest.mark.timeout(120)
def test_fsdp2_trains_on_shared_memory() -> None:
    fsdp_calls = ("allgather", "reduce_scatter")
    results = phalanx.run(_example, args=("fsdp_digits", "train_fsdp", fsdp_calls), np=2, env=NATIVE)
    assert [r[:2] for r in results] == [("phalanx_shm", True)] * 2
    assert results[0][2] > 0.5  # one epoch on digits (chance: 0.1)
    assert _leftovers() == []


@pytest.mark.timeout(150)
def test_lightning_ddp_trains_on_shared_memory() -> None:
    pytest.importorskip("lightning")
    results = phalanx.run(_example, args=("lightning_digits", "train_lightning"), np=2, env=NATIVE)
    assert [r[:2] for r in results] == [("phalanx_shm", True)] * 2
    assert results[0][2] > 0.5
    assert _leftovers() == []
