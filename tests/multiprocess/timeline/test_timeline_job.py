"""A real 2-rank job with HOROVOD_TIMELINE set: every collective and the optimizer's buckets are in the trace."""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any

import pytest

import phalanx
from phalanx.env import names as env_names
from phalanx.timeline.reader import load_trace
from phalanx.timeline.summary import summarize

pytestmark = [pytest.mark.multiprocess]
# Bounds the writer's flushes into the file, every 20 ms (generous: a loaded host); a failure names it.
FLUSH_WAIT_S = 30.0


def _job(path: str) -> dict[str, Any]:
    """Runs on every rank: a few named collectives, two optimizer steps, and a look at the trace mid-run."""
    import torch

    import phalanx.torch as hvd
    from phalanx import timeline
    from phalanx.timeline.reader import load_events

    hvd.init()
    t = torch.arange(8, dtype=torch.float32) + hvd.rank()
    hvd.allreduce(t, name="t.allreduce")
    first = _flushed(timeline.current(), "allreduce.t.allreduce")
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
    # The writer flushes every 20 ms: finished operations reach the file while the job runs.
    deadline = time.monotonic() + FLUSH_WAIT_S
    while not (mid_run := len([e for e in load_events(tl.path) if e.get("ph") == "X"])):
        if time.monotonic() > deadline:
            raise TimeoutError(f"no finished operation in {tl.path} within {FLUSH_WAIT_S:g} s of the barrier")
        time.sleep(0.01)
    hvd.shutdown()
    timeline.stop_timeline()  # hvd.shutdown() should have done it; stopping twice is harmless
    return {"path": tl.path, "mid_run": mid_run, "first": first, "interval": tl._interval_s}


def torch_model_names() -> list[tuple[str, tuple[int, ...]]]:
    """The parameters of :func:`_job`'s model: name and shape."""
    return [("0.weight", (16, 8)), ("0.bias", (16,)), ("2.weight", (2, 16)), ("2.bias", (2,))]


def _flushed(tl: Any, row: str) -> str:
    """The trace's text once the writer has flushed ``row``'s allreduce and a cycle mark (Horovod's timeline
    test reads the file 0.1 s after the op returns: the writer flushes every 20 ms; the bound is for a loaded
    host, and the test asserts the content, never the time)."""
    deadline = time.monotonic() + FLUSH_WAIT_S
    while True:
        text = Path(tl.path).read_text()
        if f'"name":"ALLREDUCE","pid":{tl.rank}' in text and "CYCLE_START" in text and row in text:
            return text
        if time.monotonic() > deadline:
            raise TimeoutError(f"{row}'s allreduce and a cycle mark not in {tl.path} within {FLUSH_WAIT_S:g} s: "
                               f"{text[-2000:]}")
        time.sleep(0.005)


@pytest.mark.timeout(120)
def test_trace_has_every_collective_and_bucket(tmp_path: Path) -> None:
    path = tmp_path / "timeline.json"
    env = {env_names.HOROVOD_TIMELINE: str(path), env_names.PHALANX_TIMELINE_ALL_RANKS: "1",
           env_names.HOROVOD_TIMELINE_MARK_CYCLES: "1"}
    results = phalanx.run(_job, args=(str(path),), np=2, env=env)
    assert [r["path"] for r in results] == [str(tmp_path / f"timeline.rank{r}.json") for r in (0, 1)]
    assert all(r["mid_run"] > 0 for r in results), results  # readable while the job runs
    # Horovod's names right after the first allreduce returned: op-prefixed row, both phases, a cycle mark.
    for r in results:
        for name in ("allreduce.t.allreduce", "NEGOTIATE_ALLREDUCE", '"ALLREDUCE"', '"CYCLE_START"'):
            assert name in r["first"], (name, r["first"])
        assert r["interval"] <= 0.05  # flushed well within Horovod's 0.1 s
    trace = load_trace([r["path"] for r in results])
    assert {s.pid for s in trace.spans} == {0, 1}  # one process per rank
    table = summarize(trace.spans)
    for activity in ("ALLREDUCE", "ALLGATHER", "BROADCAST", "ALLTOALL", "REDUCESCATTER", "BARRIER"):
        assert activity in table, f"no {activity} in {sorted(table)}"
    for rank in (0, 1):
        mine = [s for s in trace.spans if s.pid == rank]
        for op in ("allreduce", "allgather", "broadcast", "alltoall", "reducescatter"):
            ops = [s for s in mine if s.row == f"{op}.t.{op}"]  # Horovod's row names: op.name
            assert [s.name for s in ops] == [f"NEGOTIATE_{op.upper()}", op.upper()], (rank, op, ops)
            assert {"dtype", "shape"} <= set(ops[0].args) and all(s.nbytes > 0 for s in ops), ops
        # The optimizer's gradients: Horovod's row per tensor, allreduce.<parameter name>, stable over the steps;
        # each shows its wait for the bucket (QUEUE), then the bucket's copy into its buffer and its allreduce,
        # the fused operations the same event on each tensor's row, at each of 2 steps.
        grads = [s for s in mine if s.row in {f"allreduce.{n}" for n, _ in torch_model_names()}]
        for name, shape in torch_model_names():
            row = [s for s in grads if s.row == f"allreduce.{name}"]
            assert [s.name for s in row] == ["QUEUE", "MEMCPY_IN_FUSION_BUFFER", "ALLREDUCE"] * 2, (name, row)
            assert {s.args["bucket"] for s in row} == {0} and all(s.args["shape"] == list(shape) for s in row), row
            assert {s.nbytes for s in row} == {4 * math.prod(shape)}, row  # the tensor's own bytes
        fused = {(s.name, s.start_us, s.dur_us) for s in grads if s.name != "QUEUE"}
        assert len(fused) == 4, fused  # 2 steps x (copy, allreduce) of one bucket, shown on its 4 tensors' rows
        assert not [s.row for s in mine if s.row.startswith("DistributedOptimizer.bucket")]
        # Rows are stable per tensor: 2 optimizer steps and a barrier make one row each, with the activities
        # docs/timeline.md names for them (the step is not a BARRIER).
        assert {s.row for s in mine if "noname" in s.row} == set(), sorted({s.row for s in mine})
        steps = [s for s in mine if s.row == "optimizer.step"]
        assert [s.name for s in steps] == ["NEGOTIATE_ALLREDUCE", "WAIT_FOR_DATA"] * 2, steps
        assert {s.row for s in mine if s.name == "BARRIER"} == {"barrier"}
        # One CYCLE_START per negotiation round, each before its negotiation begins.
        cycles = sorted(float(e["ts"]) for e in trace.instants if e.get("pid") == rank and e["name"] == "CYCLE_START")
        negotiations = sorted(s.start_us for s in mine if s.name.startswith("NEGOTIATE_"))
        assert len(cycles) == len(negotiations) and all(c <= n for c, n in zip(cycles, negotiations, strict=True))
    # Bytes reach the summary, so its bandwidth column is filled for every collective.
    assert all(table[a][0].nbytes > 0 for a in ("ALLREDUCE", "ALLGATHER", "BROADCAST", "ALLTOALL", "REDUCESCATTER"))

