"""Issue 36, item 3: the driver's control plane (channel, monitor, exit reports, log routing) against 128
simulated ranks (bench/control_plane.py: supervisors' real client code, in threads of two processes).

Every rank forms, every numbered log line arrives in order, and the killed rank is the reported root cause.
Time bounds are the issue's, loosened for a loaded 2-core host: they catch a hang or a quadratic loop, not
a slow scheduler."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.multiprocess]

BENCH = Path(__file__).resolve().parents[3] / "bench" / "control_plane.py"
RANKS = 128
RSS_BOUND_MB = 200  # the bound for 1,024 ranks
FORMATION_BOUND_S = 10.0  # the issue asks for 2 s
VERDICT_BOUND_S = 5.0  # the issue asks for 1 s


def test_128_ranks_form_stream_every_line_and_report_the_kill() -> None:
    argv = [sys.executable, str(BENCH), "--ranks", str(RANKS), "--procs", "2", "--seconds", "1", "--json"]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    fig = json.loads(done.stdout)
    assert fig["errors"] == []
    assert fig["lines_sent"] >= RANKS * 50  # 100 lines/s for 1 s, however late the senders woke
    assert fig["lines_received"] == fig["lines_sent"]
    assert fig["out_of_order"] == 0
    assert fig["root_cause_rank"] == fig["killed_rank"]
    assert fig["formation_s"] <= FORMATION_BOUND_S
    assert fig["verdict_s"] <= VERDICT_BOUND_S
    assert fig["driver_peak_rss_mb"] <= RSS_BOUND_MB
