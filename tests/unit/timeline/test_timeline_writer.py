"""The writer: the file parses mid-run and at the end, events are complete, growth and memory are bounded."""

from __future__ import annotations

import json
import logging
import threading
import time
from pathlib import Path

import pytest
from tests.waits import wait_until

from phalanx import timeline
from phalanx.errors import PhalanxError, TimelineError
from phalanx.timeline.reader import load_events, parse_events
from phalanx.timeline.writer import Timeline

WAIT_S = 30.0  # bounds a wait for the writer thread's next flush (a loaded host); a failure names it


def _chrome_parse(text: str) -> list[dict[str, object]]:
    """Parse like Chrome: the array's closing bracket and a trailing comma may be missing."""
    body = text.rstrip()
    if not body.endswith("]"):
        body = body.rstrip(",") + "]"
    parsed = json.loads(body)
    assert isinstance(parsed, list)
    return parsed


def _spans(events: list[dict[str, object]]) -> list[dict[str, object]]:
    return [e for e in events if e.get("ph") == "X"]


def _read_between_flushes(path: Path) -> str:
    """The file's text as read between two flushes. A read that races a flush can end mid-line: the kernel
    copies a write into the file page by page, and a concurrent reader may see only the first pages (seen
    once: a read that ended at byte 12288, inside an event). phalanx's reader drops the cut line; a read a
    moment later sees the whole flush."""
    deadline = time.monotonic() + WAIT_S
    while True:
        text = path.read_text()
        try:
            _chrome_parse(text)
            return text
        except json.JSONDecodeError:
            parse_events(text)  # phalanx's own reader copes with the cut line (TimelineError if not)
            if time.monotonic() > deadline:
                raise AssertionError(f"the timeline did not parse within {WAIT_S:g} s: {text[-200:]!r}") from None
            time.sleep(0.005)


def _append_until(tl: Timeline, stop: threading.Event, counter: list[int]) -> None:
    while not stop.is_set():
        name = f"grad.{counter[0] % 3}"
        tl.begin(name, timeline.ALLREDUCE, {"dtype": "float32", "shape": [4, 4], "bytes": 64})
        tl.end(name, timeline.ALLREDUCE)
        counter[0] += 1
        time.sleep(0.0005)  # a steady producer, as a training loop is: the reads interleave with flushes


def test_file_parses_while_a_writer_thread_appends(tmp_path: Path) -> None:
    path = tmp_path / "t.json"
    tl = Timeline(str(path), flush_interval_s=0.02)
    stop, counter = threading.Event(), [0]
    producer = threading.Thread(target=_append_until, args=(tl, stop, counter))
    producer.start()
    seen: list[int] = []
    deadline = time.monotonic() + 60.0  # a loaded host may run the producer or the writer thread late
    try:
        # Read until three growing, non-empty counts were seen, each read a parseable file.
        while len(set(seen) - {0}) < 3:
            assert time.monotonic() < deadline, f"the timeline did not grow within 60 s: {seen}"
            time.sleep(0.03)  # paces the reads; the assertions do not depend on it
            text = _read_between_flushes(path)
            # Between two flushes the file is a complete open array, parseable the way Chrome parses it.
            seen.append(len(_spans(_chrome_parse(text))))
            assert len(_spans(parse_events(text))) == seen[-1]
            assert seen == sorted(seen), seen  # a flushed event is never taken back
    finally:
        stop.set()
        producer.join()
        tl.close()
    final = json.loads(path.read_text())  # closed: strict JSON
    assert len(_spans(final)) == counter[0]


def test_events_have_names_phase_args_and_rows(tmp_path: Path) -> None:
    path = tmp_path / "t.json"
    tl = Timeline(str(path))
    tl.begin("bucket.0", timeline.MEMCPY_IN_FUSION_BUFFER, {"bytes": 800})
    tl.end("bucket.0", timeline.MEMCPY_IN_FUSION_BUFFER)
    tl.begin("bucket.0", timeline.ALLREDUCE, {"dtype": "torch.float32", "shape": (10, 20), "bytes": 800})
    time.sleep(0.002)  # the span's duration, which the trace must carry (dur >= 2000 us below)
    tl.end("bucket.0", timeline.ALLREDUCE, {"op": "Average"})
    tl.instant("bucket.0", "READY")
    tl.close()
    events = json.loads(path.read_text())
    spans = _spans(events)
    assert [e["name"] for e in spans] == [timeline.MEMCPY_IN_FUSION_BUFFER, timeline.ALLREDUCE]
    allreduce = spans[1]
    assert allreduce["args"] == {"dtype": "torch.float32", "shape": [10, 20], "bytes": 800, "op": "Average"}
    assert allreduce["dur"] >= 2000  # microseconds
    assert allreduce["pid"] == 0 and allreduce["ts"] >= spans[0]["ts"]
    rows = [e for e in events if e.get("name") == "thread_name"]
    assert rows == [{"name": "thread_name", "ph": "M", "pid": 0, "tid": allreduce["tid"], "args": {"name": "bucket.0"}}]
    assert [e["name"] for e in events if e.get("ph") == "i"] == ["READY"]


def test_concurrent_threads_lose_no_event(tmp_path: Path) -> None:
    path = tmp_path / "t.json"
    tl = Timeline(str(path), flush_interval_s=0.01)
    per_thread, threads = 2000, 8

    def work(t: int) -> None:
        for i in range(per_thread):
            tl.begin(f"t{t}.grad", timeline.ALLREDUCE, {"bytes": i})
            tl.end(f"t{t}.grad", timeline.ALLREDUCE)

    workers = [threading.Thread(target=work, args=(t,)) for t in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    tl.close()
    spans = _spans(json.loads(path.read_text()))
    assert len(spans) == per_thread * threads
    assert all(e["dur"] >= 0 for e in spans)
    assert tl.dropped == 0 and tl.unmatched == 0


def test_rotation_bounds_the_files_and_keeps_each_a_trace(tmp_path: Path) -> None:
    path = tmp_path / "t.json"
    cap = 40_000
    tl = Timeline(str(path), max_bytes=cap, flush_interval_s=0.005)
    for i in range(3000):
        tl.begin(f"grad.{i % 4}", timeline.ALLREDUCE, {"bytes": 4})
        tl.end(f"grad.{i % 4}", timeline.ALLREDUCE)
        if i % 100 == 0:
            time.sleep(0.01)  # two flush intervals: the events reach the file in many flushes, as in a job
    tl.close()
    old = tmp_path / "t.json.1"
    assert old.exists()
    for segment in (path, old):
        events = json.loads(segment.read_text())
        assert segment.stat().st_size <= cap  # each segment <= cap / 2 plus at most one batch
        names = {e["args"]["name"] for e in events if e.get("name") == "thread_name"}
        assert names == {f"grad.{k}" for k in range(4)}  # every segment names its rows
    assert path.stat().st_size + old.stat().st_size <= cap


def test_a_batch_larger_than_a_segment_is_split_at_line_ends(tmp_path: Path) -> None:
    """A writer thread that runs late (a loaded host) drains one batch larger than a whole segment: the cap
    still holds, and both files parse."""
    path = tmp_path / "t.json"
    cap = 20_000
    tl = Timeline(str(path), max_bytes=cap, flush_interval_s=3600.0)  # one drain, at close
    for i in range(1000):
        tl.begin(f"grad.{i % 2}", timeline.ALLREDUCE, {"bytes": 4})
        tl.end(f"grad.{i % 2}", timeline.ALLREDUCE)
    tl.close()
    old = tmp_path / "t.json.1"
    sizes = [path.stat().st_size, old.stat().st_size]
    assert sum(sizes) <= cap, sizes
    for segment in (path, old):
        assert _spans(json.loads(segment.read_text()))


def test_pending_events_are_capped_and_counted(tmp_path: Path) -> None:
    tl = Timeline(str(tmp_path / "t.json"), flush_interval_s=60.0, max_pending=10)
    for _ in range(25):
        tl.begin("x", timeline.ALLREDUCE)
        tl.end("x", timeline.ALLREDUCE)
    assert tl.dropped == 15
    tl.close()
    assert len(_spans(load_events(str(tmp_path / "t.json")))) == 10


def test_end_without_begin_is_counted_not_written(tmp_path: Path) -> None:
    tl = Timeline(str(tmp_path / "t.json"))
    tl.end("x", timeline.ALLREDUCE)
    tl.close()
    assert tl.unmatched == 1
    assert _spans(load_events(str(tmp_path / "t.json"))) == []


def test_mark_cycles(tmp_path: Path) -> None:
    for enabled, expected in ((False, 0), (True, 2)):
        tl = Timeline(str(tmp_path / "t.json"), mark_cycles=enabled)
        tl.mark_cycle()
        tl.mark_cycle()
        tl.close()
        events = load_events(str(tmp_path / "t.json"))
        assert sum(e.get("name") == timeline.CYCLE_START for e in events) == expected


@pytest.mark.parametrize("where", ["missing_dir", "is_a_dir"])
def test_unwritable_path_fails_at_start_with_a_clear_error(tmp_path: Path, where: str) -> None:
    bad = tmp_path / "no" / "such" / "t.json" if where == "missing_dir" else tmp_path
    with pytest.raises(TimelineError) as info:
        timeline.start_timeline(str(bad))
    message = str(info.value)
    assert str(bad) in message and "HOROVOD_TIMELINE" in message
    assert isinstance(info.value, OSError) and isinstance(info.value, PhalanxError)
    assert timeline.current() is None


def test_write_failure_mid_run_logs_and_does_not_raise(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    tl = Timeline(str(tmp_path / "t.json"), flush_interval_s=0.01)

    writes: list[str] = []

    def full_disk(text: str) -> None:
        writes.append(text)
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(tl._file, "write", full_disk)
    with caplog.at_level(logging.WARNING, logger="phalanx.timeline.writer"):
        tl.begin("x", timeline.ALLREDUCE)
        tl.end("x", timeline.ALLREDUCE)
        wait_until(lambda: writes, WAIT_S, "the writer's first (failing) flush")
        for _ in range(3):  # events after the failure: neither raised nor warned about again
            tl.begin("x", timeline.ALLREDUCE)
            tl.end("x", timeline.ALLREDUCE)
        tl.close()
    assert sum("No space left" in r.getMessage() for r in caplog.records) == 1


def test_writer_thread_cpu_is_accounted(tmp_path: Path) -> None:
    tl = Timeline(str(tmp_path / "t.json"))
    for _ in range(2000):
        tl.begin("grad", timeline.ALLREDUCE, {"bytes": 4})
        tl.end("grad", timeline.ALLREDUCE)
    tl.close()
    assert 0 < tl.writer_cpu_s < 5


def test_one_record_for_several_rows_becomes_a_line_per_row(tmp_path: Path) -> None:
    """A fused bucket: begin_all/end_all record once, each row gets the event with its own args; spans()
    gives each row its own start (a tensor's QUEUE since its gradient was ready)."""
    path = tmp_path / "t.json"
    tl = Timeline(str(path))
    rows = ("allreduce.w", "allreduce.b")
    args = ({"bytes": 12, "bucket": 0}, {"bytes": 4, "bucket": 0})
    first = timeline.clock_ns()
    second = timeline.clock_ns()
    tl.spans(rows, timeline.QUEUE, (first, second), args)
    tl.begin_all("opt.bucket0", rows, timeline.ALLREDUCE, args)
    tl.end_all("opt.bucket0", timeline.ALLREDUCE)
    tl.end_all("opt.bucket0", timeline.ALLREDUCE)  # no begin any more: counted, not written
    tl.close()
    events = load_events(str(path))
    names = {e["tid"]: e["args"]["name"] for e in events if e.get("name") == "thread_name"}
    spans = [(names[e["tid"]], e["name"], e["ts"], e["dur"], e["args"]["bytes"]) for e in events if e.get("ph") == "X"]
    queue = [s for s in spans if s[1] == "QUEUE"]
    assert [(r, b) for r, _, _, _, b in queue] == [("allreduce.w", 12), ("allreduce.b", 4)]
    assert float(queue[0][2]) <= float(queue[1][2])  # each row from its own start
    fused = [s for s in spans if s[1] == "ALLREDUCE"]
    assert [r for r, *_ in fused] == list(rows) and len({(t, d) for _, _, t, d, _ in fused}) == 1
    assert tl.unmatched == 1
