"""``*_async`` collectives run on a background thread (Horovod's asynchrony): the call returns before the
data has moved, ``poll`` stays False until it has, and the order of issue is kept with synchronous calls.
Named collectives match across ranks by name, whatever each rank issued in between (Horovod's coordinator)."""

from __future__ import annotations

import os
from typing import Any

import pytest

import phalanx

pytestmark = [pytest.mark.multiprocess]


def _async_job() -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    import phalanx.torch as hvd

    hvd.init()
    store = dist.distributed_c10d._get_default_store()
    me, out = int(os.environ["RANK"]), {}
    x = torch.ones(1 << 20)
    if me == 1:
        store.wait(["rank 0 looked"])  # rank 0's allreduce cannot complete before rank 1 issues it
    handle = hvd.allreduce_async_(x, op=hvd.Sum, name="big")
    if me == 0:
        out["poll before the peer"] = hvd.poll(handle)
        out["data before the peer"] = x[0].item()
        try:
            hvd.allreduce_async(x, name="big")
            out["duplicate"] = "no error"
        except ValueError as e:
            out["duplicate"] = str(e)
        store.set("rank 0 looked", "1")
    small = hvd.allreduce(torch.ones(2) * (me + 1), op=hvd.Sum)  # synchronous: runs after "big"
    out["poll after a later call"] = hvd.poll(handle)
    out["big"] = hvd.synchronize(handle)[-1].item()
    out["small"] = small.tolist()
    handles = [hvd.allgather_async(torch.tensor([me, i])) for i in range(5)]
    out["gathered"] = [hvd.synchronize(h).tolist() for h in reversed(handles)]
    bad = hvd.allreduce_async(torch.ones(3 + me), name="shapes")
    try:
        hvd.synchronize(bad)
        out["mismatch"] = "no error"
    except RuntimeError as e:
        out["mismatch"] = f"{type(e).__name__}: {e}"
    out["by name"] = _by_name(me)
    hvd.shutdown()
    return out


def _by_name(me: int) -> dict[str, Any]:
    """Each rank issues the same named collectives in its own order, with other collectives in between."""
    import torch

    import phalanx.torch as hvd

    out: dict[str, Any] = {}
    if me == 0:  # pending until rank 1 issues "late", after the barrier
        late = hvd.allreduce_async(torch.ones(3), op=hvd.Sum, name="late")
        out["poll while the peer has not issued it"] = hvd.poll(late)
        out["second late"] = _value_error(lambda: hvd.allreduce_async(torch.ones(3), name="late"))
    hvd.barrier()
    if me == 1:
        late = hvd.allreduce_async(torch.ones(3) * 2, op=hvd.Sum, name="late")
    out["late"] = hvd.synchronize(late).tolist()
    # Opposite orders, different shapes per name: only matching by name gives these results.
    names = ["x", "y"] if me == 0 else ["y", "x"]
    handles = {n: hvd.allgather_async(torch.full((1, 2 if n == "x" else 3), float(me)), name=n) for n in names}
    out["gathered"] = {n: hvd.synchronize(h).tolist() for n, h in handles.items()}
    # A synchronous call waits for a peer that issues an async one of another name first.
    if me == 1:
        other = hvd.broadcast_async(torch.full((2,), float(me)), root_rank=1, name="other")
    out["sync"] = hvd.allreduce(torch.ones(2), op=hvd.Sum, name="sync").tolist()
    if me == 0:
        other = hvd.broadcast_async(torch.full((2,), float(me)), root_rank=1, name="other")
    out["other"] = hvd.synchronize(other).tolist()
    # A finished collective frees its name, synchronized or not (rank 0's finishes in its second barrier).
    if me == 0:
        hvd.allreduce_async(torch.ones(1), name="free")
    hvd.barrier()
    if me == 1:
        hvd.allreduce_async(torch.ones(1), name="free")
    hvd.barrier()
    out["reuse"] = hvd.synchronize(hvd.allreduce_async(torch.ones(1), op=hvd.Sum, name="free")).tolist()
    return out


def _value_error(fn: Any) -> str:
    try:
        fn()
    except ValueError as e:
        return str(e)
    return "no error"


@pytest.mark.timeout(90)
def test_async_collectives_run_in_the_background_in_issue_order() -> None:
    r0, r1 = phalanx.run(_async_job, np=2)
    assert r0["poll before the peer"] is False and r0["data before the peer"] == 1.0
    assert "already in flight" in r0["duplicate"]
    for r in (r0, r1):
        assert r["poll after a later call"] is True and r["big"] == 2.0 and r["small"] == [3.0, 3.0]
        assert r["gathered"] == [[0, i, 1, i] for i in reversed(range(5))]
        assert r["mismatch"].startswith("CollectiveMismatchError"), r["mismatch"]
        by_name = r["by name"]
        assert by_name["late"] == [3.0] * 3
        assert by_name["gathered"] == {"x": [[0.0, 0.0], [1.0, 1.0]], "y": [[0.0, 0.0, 0.0], [1.0, 1.0, 1.0]]}
        assert by_name["sync"] == [2.0, 2.0] and by_name["other"] == [1.0, 1.0]
        assert by_name["reuse"] == [2.0]
    assert r0["by name"]["poll while the peer has not issued it"] is False
    assert "'late' is already in flight" in r0["by name"]["second late"]
