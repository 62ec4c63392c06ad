"""The driver's exit reports of supervised ranks: bounded threads at any scale, no report lost or doubled."""

from __future__ import annotations

import json
import queue
import threading

import pytest

from phalanx.job.channel import Custom
from phalanx.job.monitor import RankExit
from phalanx.launch.supervisor import ExitReports, exit_event

RANKS = 1024


class _Channel:
    """The part of a DriverChannel the reports use: every rank's worker connection is open until closed here."""

    def __init__(self, ranks: int) -> None:
        self.events: queue.Queue[object] = queue.Queue()
        self.closed = [threading.Event() for _ in range(ranks)]

    def is_connected(self, rank: int) -> bool:
        return True

    def worker_done(self, rank: int, timeout_s: float) -> bool:
        return self.closed[rank].wait(timeout_s)


@pytest.mark.timeout(60)
def test_a_thousand_exits_hold_one_thread_and_every_report_arrives() -> None:
    channel = _Channel(RANKS)
    reports = ExitReports(function_job=True)
    reports.attach(channel)  # type: ignore[arg-type]
    before = threading.active_count()
    busiest = before
    for rank in range(RANKS):  # every rank ended; its result is still in flight
        assert reports.on_event(Custom(rank, exit_event(rank % 3)))
        busiest = max(busiest, threading.active_count())
    assert not reports.on_event(Custom(0, json.dumps({"beat": 1}).encode()))
    assert channel.events.empty()  # none is posted before its worker connection was read out
    for rank in reversed(range(RANKS)):
        channel.closed[rank].set()
        busiest = max(busiest, threading.active_count())
    posted = [channel.events.get(timeout=30) for _ in range(RANKS)]
    assert busiest - before <= 1, f"{busiest - before} threads for {RANKS} exits"
    assert all(isinstance(e, RankExit) for e in posted)
    assert sorted((e.rank, e.returncode) for e in posted) == [(r, r % 3) for r in range(RANKS)]  # type: ignore[attr-defined]
    assert reports.reported(range(RANKS))
