"""``*_async`` collectives run on a background thread (Horovod's asynchrony): the call returns before the
data has moved, ``poll`` stays False until it has, and the order of issue is kept with synchronous calls."""

from __future__ import annotations

import os
import time
from typing import Any

import pytest

import phalanx

pytestmark = [pytest.mark.multiprocess]


def _async_job() -> dict[str, Any]:
    import torch

    import phalanx.torch as hvd

    hvd.init()
    me, out = int(os.environ["RANK"]), {}
    x = torch.ones(1 << 20)
    if me == 1:
        time.sleep(1.0)  # rank 0's allreduce cannot complete before rank 1 issues it
    handle = hvd.allreduce_async_(x, op=hvd.Sum, name="big")
    if me == 0:
        out["poll before the peer"] = hvd.poll(handle)
        out["data before the peer"] = x[0].item()
        try:
            hvd.allreduce_async(x, name="big")
            out["duplicate"] = "no error"
        except ValueError as e:
            out["duplicate"] = str(e)
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
    hvd.shutdown()
    return out


@pytest.mark.timeout(90)
def test_async_collectives_run_in_the_background_in_issue_order() -> None:
    r0, r1 = phalanx.run(_async_job, np=2)
    assert r0["poll before the peer"] is False and r0["data before the peer"] == 1.0
    assert "already in flight" in r0["duplicate"]
    for r in (r0, r1):
        assert r["poll after a later call"] is True and r["big"] == 2.0 and r["small"] == [3.0, 3.0]
        assert r["gathered"] == [[0, i, 1, i] for i in reversed(range(5))]
        assert r["mismatch"].startswith("CollectiveMismatchError"), r["mismatch"]
