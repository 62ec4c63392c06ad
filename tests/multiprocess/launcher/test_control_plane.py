"""Issue 36, item 3: the driver's control plane (channel, monitor, exit reports, log routing, the store and
elastic re-formation) against 128 simulated ranks (bench/control_plane.py: supervisors' real client code, in
threads of two processes).

Every rank forms, every numbered log line arrives in order, and the killed rank is the reported root cause;
in an elastic job, two ranks lost one after the other each re-form the world through the store, and the job
succeeds. Time bounds are the issue's, loosened for a loaded 2-core host: they catch a hang or a quadratic
loop, not a slow scheduler."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytestmark = [pytest.mark.multiprocess]

BENCH = Path(__file__).resolve().parents[3] / "bench" / "control_plane.py"
RANKS = 128
RSS_BOUND_MB = 200  # the bound for 1,024 ranks
FORMATION_BOUND_S = 10.0  # the issue asks for 2 s
VERDICT_BOUND_S = 5.0  # the issue asks for 1 s
THREADS_BOUND = 32  # the driver's threads at formation, with greeting threads not yet ended
REFORM_BOUND_S = 30.0  # no bound in the issue: this one catches a survivor stuck in its wait


def _run(*extra: str) -> dict[str, Any]:
    argv = [sys.executable, str(BENCH), "--ranks", str(RANKS), "--procs", "2", "--seconds", "1", "--json", *extra]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr
    fig: dict[str, Any] = json.loads(done.stdout)
    assert fig["errors"] == []
    assert fig["lines_sent"] >= RANKS * 50  # 100 lines/s for 1 s, however late the senders woke
    assert fig["lines_received"] == fig["lines_sent"]
    assert fig["out_of_order"] == 0
    assert fig["formation_s"] <= FORMATION_BOUND_S
    assert fig["driver_peak_rss_mb"] <= RSS_BOUND_MB
    assert fig["driver_threads"] <= THREADS_BOUND  # one loop reads every rank (a thread per rank: >= 128)
    return fig


def test_128_ranks_form_stream_every_line_and_report_the_kill() -> None:
    fig = _run()
    assert fig["root_cause_rank"] == fig["killed_rank"]
    assert fig["verdict_s"] <= VERDICT_BOUND_S


def test_128_ranks_lose_two_one_at_a_time_and_re_form_through_the_store() -> None:
    fig = _run("--elastic", "2")
    assert fig["job_succeeded"]
    assert fig["world_after"] == RANKS - 2
    assert fig["loss_reported_s"] <= VERDICT_BOUND_S
    assert fig["round_published_s"] <= fig["reformed_s"] <= REFORM_BOUND_S
