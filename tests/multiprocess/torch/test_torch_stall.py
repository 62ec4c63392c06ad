"""Ranks blocked on collectives of different process sets raise on every rank (the stall inspector), and a
merely slow rank does not."""

from __future__ import annotations

import os
import re
import time
from typing import Any

import pytest

import phalanx

pytestmark = [pytest.mark.multiprocess]


def _stall_job() -> dict[str, Any]:
    import torch

    import phalanx.torch as hvd

    me = int(os.environ["RANK"])
    if os.environ.get("TEST_HOSTS"):  # ranks 0, 1 on one host, rank 2 on another: the global set is hierarchical
        os.environ["HOROVOD_HOSTNAME"] = os.environ["TEST_HOSTS"].split(",")[me]
    a, b = hvd.ProcessSet([0, 1]), hvd.ProcessSet([1, 2])
    hvd.init(process_sets=[a, b])
    report: dict[str, Any] = {}
    # Slow, not stuck: rank 0 waits on [0, 1] for rank 1, which waits on [1, 2] for rank 2, which computes.
    if me == 0:
        report["slow"] = hvd.allreduce(torch.ones(3), op=hvd.Sum, process_set=a).tolist()
    if me == 2:
        time.sleep(3.0)  # three check intervals
    if me in (1, 2):
        hvd.allreduce(torch.ones(3), op=hvd.Sum, process_set=b)
    if me == 1:
        report["slow"] = hvd.allreduce(torch.ones(3), op=hvd.Sum, process_set=a).tolist()
    report["global"] = hvd.allreduce(torch.ones(50_000), op=hvd.Sum, name="g").sum().item()
    # Stuck: rank 0 issues on [0, 1], ranks 1 and 2 on [1, 2], then everyone on the global set.
    start = time.monotonic()
    try:
        if me == 0:
            hvd.allreduce(torch.ones(4), name="on.a", process_set=a)
        else:
            hvd.allreduce(torch.ones(4), name="on.b", process_set=b)
        hvd.allreduce(torch.ones(4), name="after")
        report["error"] = "no error"
    except RuntimeError as e:
        report["error"] = f"{type(e).__name__}: {e}"
    report["seconds"] = time.monotonic() - start
    try:  # the abandoned sets refuse further collectives instead of mixing them up
        hvd.allreduce(torch.ones(4), name="later")
        report["later"] = "no error"
    except RuntimeError as e:
        report["later"] = f"{type(e).__name__}: {e}"
    hvd.shutdown()
    return report


@pytest.mark.timeout(120)
@pytest.mark.parametrize("shm", ["1", "0", "hosts"])
def test_ranks_blocked_on_different_process_sets_raise_on_every_rank(shm: str) -> None:
    """``hosts``: rank 2, alone on its host, waits as its host's leader in gloo among the leaders (inspected)."""
    env = {"PHALANX_STALL_CHECK_S": "1", "PHALANX_SHM": "0" if shm == "0" else "1"}
    if shm == "hosts":
        env["TEST_HOSTS"] = "hostA,hostA,hostB"
    reports = phalanx.run(_stall_job, np=3, env=env)
    assert [r.get("slow") for r in reports] == [[2.0] * 3, [2.0] * 3, None]
    assert all(r["global"] == 150_000.0 for r in reports)
    print("seconds to raise:", [round(r["seconds"], 1) for r in reports])
    for rank, report in enumerate(reports):
        error = report["error"]
        assert error.startswith("CollectiveMismatchError: ranks are blocked on collectives of different"), error
        assert "rank 0 waits in allreduce of tensor 'on.a' on process set 1 (ranks [0, 1]" in error, error
        assert "rank 1 waits in allreduce of tensor 'after' on process set 0 (ranks [0, 1, 2]" in error, error
        assert "its collective #2 there) for rank 1 issued 1 there" in error, error
        assert re.search(r"#(\d+) there\) for rank 0 issued (\d+) there", error), error
        assert report["seconds"] < 30, (rank, report["seconds"])  # check 1 s: detected within ~3 s
        assert report["later"].startswith("CollectiveMismatchError: process set ranks [0, 1, 2] cannot"), report


def _join_job(case: str) -> dict[str, Any]:
    import torch

    import phalanx.torch as hvd

    me = int(os.environ["RANK"])
    ps = hvd.ProcessSet([1, 2])
    hvd.init(process_sets=[ps])
    opt = None
    if me in (1, 2) and case == "optimizer":  # construction is collective on the set
        model = torch.nn.Linear(4, 1)
        sgd = torch.optim.SGD(model.parameters(), lr=0.1)
        opt = hvd.DistributedOptimizer(sgd, named_parameters=model.named_parameters(), process_set=ps)
    report: dict[str, Any] = {}
    start = time.monotonic()
    try:
        if me in (0, 2):  # rank 2 joins, but a joined rank serves only the global set
            hvd.join()
        elif opt is None:
            hvd.allreduce(torch.ones(4), name="on.p", process_set=ps)
        else:
            model(torch.ones(2, 4)).sum().backward()
            opt.step()
        report["error"] = "no error"
    except RuntimeError as e:
        report["error"] = f"{type(e).__name__}: {e}"
    report["seconds"] = time.monotonic() - start
    hvd.shutdown()
    return report


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("case", "shm"), [("allreduce", "1"), ("optimizer", "0")])
def test_collectives_on_a_process_set_with_a_joined_rank_raise_instead_of_hanging(case: str, shm: str) -> None:
    reports = phalanx.run(_join_job, args=(case,), np=3, env={"PHALANX_STALL_CHECK_S": "1", "PHALANX_SHM": shm})
    print("seconds to raise:", [round(r["seconds"], 1) for r in reports])
    what = "allreduce of tensor 'on.p'" if case == "allreduce" else "optimizer step"
    for report in reports:
        error = report["error"]
        assert error.startswith("CollectiveMismatchError: ranks are blocked on collectives"), error
        assert f"rank 1 waits in {what}" in error and "(ranks [1, 2]" in error, error
        assert "rank 2 waits in join" in error and "rank 0 waits in join" in error, error
        assert "Rank(s) [0, 2] called hvd.join(), which serves only the global process set" in error, error
        assert report["seconds"] < 30, report["seconds"]
