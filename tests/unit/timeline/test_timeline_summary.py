"""The summary's numbers agree with the events they come from."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from phalanx import timeline
from phalanx.timeline.reader import Span, load_trace
from phalanx.timeline.summary import ALL_TENSORS, per_rank, render, render_table, straggler, summarize
from phalanx.timeline.writer import Timeline


def _span(name: str, row: str, start: float, dur: float, nbytes: int = 0, pid: int = 0) -> Span:
    return Span(pid, 1, row, name, start, dur, {"bytes": nbytes} if nbytes else {})


def test_exact_numbers() -> None:
    spans = [
        _span("ALLREDUCE", "a", 0, 1000, 4_000_000),
        _span("ALLREDUCE", "a", 2000, 3000, 4_000_000),
        _span("ALLREDUCE", "b", 0, 500, 1_000_000),
        _span("NEGOTIATE_ALLREDUCE", "a", 0, 100),
    ]
    table = summarize(spans)
    assert list(table) == ["NEGOTIATE_ALLREDUCE", "ALLREDUCE"]  # Horovod's pipeline order
    total, a, b = table["ALLREDUCE"]
    assert (total.tensor, total.count, total.nbytes, total.total_us) == (ALL_TENSORS, 3, 9_000_000, 4500.0)
    assert (a.tensor, a.count, a.nbytes, a.total_us, a.mean_us) == ("a", 2, 8_000_000, 4000.0, 2000.0)
    assert a.gbps == pytest.approx(8e6 / 4000e-6 / 1e9)  # 2 GB/s
    assert b.gbps == pytest.approx(2.0)
    assert table["NEGOTIATE_ALLREDUCE"][0].gbps is None  # negotiation moves no data


def test_summary_agrees_with_the_written_events(tmp_path: Path) -> None:
    path = tmp_path / "t.json"
    tl = Timeline(str(path))
    for i in range(30):
        name = f"bucket.{i % 3}"
        tl.begin(name, timeline.ALLREDUCE, {"bytes": 1000 * (i % 3 + 1)})
        time.sleep(0.0002)  # each span lasts: the summary's durations are what it reports
        tl.end(name, timeline.ALLREDUCE)
        tl.begin(name, timeline.QUEUE)
        tl.end(name, timeline.QUEUE)
    tl.close()
    raw = json.loads(path.read_text())
    rows = {e["tid"]: e["args"]["name"] for e in raw if e.get("name") == "thread_name"}
    table = summarize(load_trace([str(path)]).spans)
    for r in table["ALLREDUCE"][1:]:
        mine = [e for e in raw if e.get("ph") == "X" and e["name"] == "ALLREDUCE" and rows[e["tid"]] == r.tensor]
        assert r.count == len(mine) == 10
        assert r.nbytes == sum(e["args"]["bytes"] for e in mine)
        assert r.total_us == pytest.approx(sum(e["dur"] for e in mine))
    assert table["ALLREDUCE"][0].count == 30 and table["QUEUE"][0].count == 30


def test_straggler_is_the_rank_that_negotiates_least() -> None:
    spans = [_span("NEGOTIATE_ALLREDUCE", "g", 0, d, pid=r) for r, d in ((0, 9000), (1, 8000), (2, 200))]
    spans += [_span("ALLREDUCE", "g", 0, 100, 10, pid=r) for r in range(3)]
    ranks = per_rank(spans)
    assert [(r.rank, r.ops, r.negotiate_us, r.transfer_us) for r in ranks] == [
        (0, 2, 9000.0, 100.0),
        (1, 2, 8000.0, 100.0),
        (2, 2, 200.0, 100.0),
    ]
    assert straggler(ranks) == 2
    assert straggler(per_rank([_span("NEGOTIATE_ALLREDUCE", "g", 0, 5000, pid=r) for r in range(3)])) is None


def test_render(tmp_path: Path) -> None:
    spans = [_span("ALLREDUCE", f"grad.{i}", i * 10, 5, 100) for i in range(15)]
    text = render_table(summarize(spans), top=3)
    assert "(all tensors)" in text and "... 12 more tensors" in text
    assert len(render_table(summarize(spans), top=0).splitlines()) == 2 + 16
    path = tmp_path / "t.json"
    tl = Timeline(str(path))
    tl.close()
    assert "no finished operations" in render(load_trace([str(path)]))


def test_names_sort_numerically_and_long_ones_shorten_in_the_middle() -> None:
    spans = [_span("ALLREDUCE", f"allreduce.noname.{i}", i, 5.0) for i in (10, 2, 1)]
    rows = summarize(spans)["ALLREDUCE"]
    assert [r.tensor for r in rows] == [ALL_TENSORS, "allreduce.noname.1", "allreduce.noname.2",
                                        "allreduce.noname.10"]
    long = "allreduce.module.encoder.layers.11.attention.output.dense.weight"
    table = render_table(summarize([_span("ALLREDUCE", long, 0, 5.0)]))
    (shown,) = [f[1] for f in map(str.split, table.splitlines()) if len(f) > 1 and f[1].endswith("dense.weight")]
    assert len(shown) == 34 and shown.startswith("allreduce.module.") and "..." in shown, table


def test_per_step_control_collectives_keep_one_row() -> None:
    # white-box: the engine's timeline row names (Horovod's), internal (no public name)
    from phalanx.torch._engine.core import timeline_row

    assert {timeline_row("optimizer step", None, h) for h in range(230)} == {"optimizer.step"}
    assert timeline_row("barrier", None, 7) == "barrier" and timeline_row("allreduce", "w", 3) == "allreduce.w"
    assert timeline_row("allreduce", None, 3) == "allreduce.noname.3"  # Horovod's name for unnamed tensors


def test_a_fused_operation_on_several_rows_counts_once_in_the_totals() -> None:
    """Horovod's timeline shows a fusion as the same event on each fused tensor's row: the per-tensor rows
    keep it, the totals (the bandwidth, the per-rank times) count its time once and every tensor's bytes."""
    spans = [
        _span("ALLREDUCE", "allreduce.w", 0, 1000, 3_000_000),
        _span("ALLREDUCE", "allreduce.b", 0, 1000, 1_000_000),  # the same bucket's allreduce
        _span("ALLREDUCE", "allreduce.w", 5000, 1000, 3_000_000, pid=1),  # the other rank's own
    ]
    total, w, b = summarize(spans)["ALLREDUCE"]
    assert (total.count, total.nbytes, total.total_us) == (2, 7_000_000, 2000.0)
    assert total.gbps == pytest.approx(7e6 / 2000e-6 / 1e9)
    assert (w.count, w.total_us, b.count, b.total_us) == (2, 2000.0, 1, 1000.0)
    assert [(r.ops, r.transfer_us) for r in per_rank(spans)] == [(1, 1000.0), (1, 1000.0)]
