"""The ``phalanx_shm`` group that stands in for gloo checks what gloo checks and waits as long as the group's
timeout: ranks that disagree raise on every rank instead of exchanging wrong data (issue 24 items 5, 6)."""

from __future__ import annotations

import os
import time
from typing import Any

import pytest

import phalanx

pytestmark = [pytest.mark.multiprocess]


def _disagree() -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    cases = {
        "size": lambda: dist.all_reduce(torch.ones(4 if rank == 0 else 6)),
        "dtype": lambda: dist.all_reduce(torch.ones(4, dtype=torch.float32 if rank == 0 else torch.float64)),
        "op": lambda: dist.all_reduce(torch.ones(4), op=dist.ReduceOp.SUM if rank == 0 else dist.ReduceOp.MAX),
        "broadcast": lambda: dist.broadcast(torch.ones(2 if rank == 0 else 4), src=0),
        "kind": lambda: dist.barrier() if rank == 0 else dist.all_reduce(torch.ones(1)),
    }
    errors = {}
    for name, call in cases.items():
        try:
            call()
            errors[name] = None
        except Exception as e:
            errors[name] = f"{type(e).__name__}: {e}"
    agreed = torch.ones(3) * (rank + 1)
    dist.all_reduce(agreed)  # the group still works after the mismatches
    out = {"backend": f"{dist.get_backend()} {dist.get_backend_config()}", "errors": errors, "after": agreed.tolist()}
    dist.destroy_process_group()
    return out


@pytest.mark.timeout(180)
def test_ranks_that_disagree_raise_on_every_rank_and_never_get_wrong_data() -> None:
    out = phalanx.run(_disagree, np=2)
    assert {o["backend"] for o in out} == {"gloo cpu:phalanx_shm,cuda:gloo"}
    for o in out:
        for name, error in o["errors"].items():
            assert error is not None, f"{name}: a mismatch went through"
            assert "different collectives" in error, (name, error)
        assert "allreduce(float32[4], SUM)" in o["errors"]["size"]
        assert "allreduce(float32[6], SUM)" in o["errors"]["size"]
        assert "float64[4]" in o["errors"]["dtype"] and "MAX" in o["errors"]["op"]
        assert "broadcast(float32[2], root 0)" in o["errors"]["broadcast"]
        assert o["after"] == [3.0, 3.0, 3.0]


def _one_rank_skips() -> str:
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", timeout=timedelta(seconds=3))
    if dist.get_rank() == 1:
        time.sleep(10)  # never joins the allreduce; stays alive, so only the timeout (3 s) can end rank 0's wait
        return "skipped"
    try:
        dist.all_reduce(torch.ones(1))
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    return "no error"


@pytest.mark.timeout(180)
def test_a_wait_gives_up_at_the_groups_timeout() -> None:
    out = phalanx.run(_one_rank_skips, np=2)
    assert out[1] == "skipped"
    assert "within 3 s" in out[0] and "init_process_group(timeout=...)" in out[0], out[0]




def _rank0_killed_in_setup() -> None:
    """Rank 0 dies by SIGKILL inside the transport's set-up, right after it created the segment and its
    wake-up FIFO and published their names (before the names are unlinked)."""
    import signal
    from datetime import timedelta

    import torch.distributed as dist

    from phalanx.transport import backend

    if os.environ["RANK"] == "0":
        backend._wait_count = lambda *a: os.kill(os.getpid(), signal.SIGKILL)  # type: ignore[assignment]
    dist.init_process_group("gloo", timeout=timedelta(seconds=5))


@pytest.mark.timeout(180)
def test_files_of_a_rank_killed_during_setup_are_removed_by_the_driver() -> None:
    from phalanx.errors import WorkerFailedError

    before = set(_leftovers())
    with pytest.raises(WorkerFailedError) as info:
        phalanx.run(_rank0_killed_in_setup, np=2)
    assert info.value.root_cause.rank == 0 and "SIGKILL" in info.value.root_cause.summary
    assert set(_leftovers()) <= before  # the segment and rank 0's FIFO are gone when run() returns


def _leftovers() -> list[str]:
    return sorted(n for n in os.listdir("/dev/shm") if n.startswith("phalanx-shm-"))
