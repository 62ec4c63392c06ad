"""A real 2-rank job with HOROVOD_TIMELINE set: every collective and the optimizer's buckets are in the trace."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

import phalanx
from phalanx.env import names as N
from phalanx.timeline.reader import load_trace
from phalanx.timeline.summary import summarize

pytestmark = [pytest.mark.multiprocess]


def _job(path: str) -> dict[str, Any]:
    """Runs on every rank: a few named collectives, two optimizer steps, and a look at the trace mid-run."""
    import torch

    import phalanx.torch as hvd
    from phalanx import timeline
    from phalanx.timeline.reader import load_events

    hvd.init()
    t = torch.arange(8, dtype=torch.float32) + hvd.rank()
    hvd.allreduce(t, name="t.allreduce")
    hvd.allgather(t, name="t.allgather")
    hvd.broadcast(t, root_rank=0, name="t.broadcast")
    hvd.alltoall(t, name="t.alltoall")
    hvd.reducescatter(t, name="t.reducescatter")
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
    opt = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=model.named_parameters()
    )
    for _ in range(2):
        opt.zero_grad()
        model(torch.randn(4, 8)).sum().backward()
        opt.step()
    hvd.barrier()
    tl = timeline.current()
    assert tl is not None and tl.recording, "HOROVOD_TIMELINE did not start the timeline in hvd.init()"
    time.sleep(0.5)  # > the writer's flush interval: finished operations must be in the file by now
    mid_run = len([e for e in load_events(tl.path) if e.get("ph") == "X"])
    hvd.shutdown()
    timeline.stop_timeline()  # hvd.shutdown() should have done it; stopping twice is harmless
    return {"path": tl.path, "mid_run": mid_run}


@pytest.mark.timeout(120)
def test_trace_has_every_collective_and_bucket(tmp_path: Path) -> None:
    path = tmp_path / "timeline.json"
    env = {N.HOROVOD_TIMELINE: str(path), N.PHALANX_TIMELINE_ALL_RANKS: "1"}
    results = phalanx.run(_job, args=(str(path),), np=2, env=env)
    assert [r["path"] for r in results] == [str(tmp_path / f"timeline.rank{r}.json") for r in (0, 1)]
    assert all(r["mid_run"] > 0 for r in results), results  # readable while the job runs
    trace = load_trace([r["path"] for r in results])
    assert {s.pid for s in trace.spans} == {0, 1}  # one process per rank
    table = summarize(trace.spans)
    for activity in ("ALLREDUCE", "ALLGATHER", "BROADCAST", "ALLTOALL", "REDUCESCATTER", "BARRIER"):
        assert activity in table, f"no {activity} in {sorted(table)}"
    for rank in (0, 1):
        mine = [s for s in trace.spans if s.pid == rank]
        for op in ("allreduce", "allgather", "broadcast", "alltoall", "reducescatter"):
            ops = [s for s in mine if s.row == f"t.{op}"]
            assert [s.name for s in ops] == [f"NEGOTIATE_{op.upper()}", op.upper()], (rank, op, ops)
            assert {"dtype", "shape"} <= set(ops[0].args) and all(s.nbytes > 0 for s in ops), ops
        # The optimizer's fused buckets: the copy into the buffer, then the allreduce, at each of 2 steps.
        buckets = [s for s in mine if s.row.startswith("DistributedOptimizer.bucket")]
        assert [s.name for s in buckets][:2] == ["MEMCPY_IN_FUSION_BUFFER", "ALLREDUCE"], buckets
        assert sum(s.name == "ALLREDUCE" for s in buckets) >= 2 and all(s.nbytes > 0 for s in buckets)
    # Bytes reach the summary, so its bandwidth column is filled for every collective.
    assert all(table[a][0].nbytes > 0 for a in ("ALLREDUCE", "ALLGATHER", "BROADCAST", "ALLTOALL", "REDUCESCATTER"))
