"""The driver's bounded event queue and long lines in pieces: memory stays bounded, nothing is dropped."""

from __future__ import annotations

import io
import queue
import threading
import time
from pathlib import Path

import pytest

from phalanx.job.events import EventQueue
from phalanx.job.logs import PIECE_BYTES, ConsoleSink, FileSink, TailBuffer, pump_lines
from phalanx.job.records import LogLine, Stream


def test_a_full_queue_blocks_its_producer_until_the_reader_catches_up() -> None:
    q = EventQueue(max_events=3, max_bytes=1 << 20)
    produced: list[int] = []

    def produce() -> None:
        for i in range(10):
            q.put(LogLine(0, Stream.STDOUT, f"line {i}"))
            produced.append(i)

    t = threading.Thread(target=produce, daemon=True)
    t.start()
    t.join(0.5)
    assert t.is_alive() and len(produced) == 3  # back-pressure: the producer waits, nothing is dropped
    got = [q.get(timeout=5).text for _ in range(10)]
    t.join(5)
    assert got == [f"line {i}" for i in range(10)]


def test_the_byte_budget_holds_and_one_oversized_event_still_passes() -> None:
    q = EventQueue(max_events=100, max_bytes=1000)
    q.put(LogLine(0, Stream.STDOUT, "x" * 5000))  # alone in the queue: let in
    with pytest.raises(queue.Full):
        q.put(LogLine(0, Stream.STDOUT, "y"), block=False)
    assert q.get_nowait().text == "x" * 5000
    q.put(LogLine(0, Stream.STDOUT, "y"), block=False)


class _CountingQueue(EventQueue):
    """Counts how often a waiting producer re-checks for room (each check is one wake-up)."""

    checks = 0

    def _fits(self, size: int) -> bool:
        self.checks += 1
        return super()._fits(size)


def test_a_full_queue_does_not_wake_every_blocked_producer_per_event() -> None:
    """1,024 ranks' readers blocked on a full queue: waking all of them for every event read made the
    driver's reading quadratic (it stalled at 1,024 simulated ranks; bench/control_plane.py)."""
    producers, each = 100, 10
    q = _CountingQueue(max_events=50, max_bytes=1 << 20)
    threads = [threading.Thread(target=lambda: [q.put(LogLine(0, Stream.STDOUT, "x")) for _ in range(each)],
                                daemon=True) for _ in range(producers)]
    for t in threads:
        t.start()
    got = 0
    for _ in range(producers * each):  # a reader slower than its producers, as a loaded driver is
        got += q.get(timeout=10) is not None
        time.sleep(0.0002)  # under test: the slow reader
    for t in threads:
        t.join(10)
    assert got == producers * each and not any(t.is_alive() for t in threads)
    assert q.checks < 20 * got, q.checks  # every blocked producer per event: ~producers * got


def test_close_lets_blocked_producers_through() -> None:
    q = EventQueue(max_events=1)
    q.put(LogLine(0, Stream.STDOUT, "a"))
    t = threading.Thread(target=q.put, args=(LogLine(0, Stream.STDOUT, "b"),), daemon=True)
    t.start()
    q.close()
    t.join(5)
    assert not t.is_alive()


def test_a_long_line_travels_in_pieces_and_is_written_whole(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    text = "é" * (PIECE_BYTES // 2 + 10) + "z" * 7  # a UTF-8 character straddles a piece boundary
    pieces: list[LogLine] = []
    pump_lines(io.BytesIO((text + "\nshort\n").encode()), 3, Stream.STDOUT, pieces.append)
    assert len(pieces) == 3 and [p.more for p in pieces] == [True, False, False]
    assert max(len(p.text.encode()) for p in pieces) <= PIECE_BYTES
    assert all(LogLine.decode(p.encode()) == p for p in pieces)
    console, tail = ConsoleSink(), TailBuffer()
    files = FileSink(str(tmp_path))
    for p in pieces:
        console.write(p)
        files.write(p)
        tail.write(p)
    files.close()
    assert capsys.readouterr().out == f"[3]<stdout>:{text}\n[3]<stdout>:short\n"
    assert (tmp_path / "rank.3" / "stdout").read_text() == f"{text}\nshort\n"
    first, second = tail.tail(3)
    assert first.startswith("é" * 100) and first.endswith(f"({len(text) - 1000} more characters)")
    assert second == "short"


def test_another_ranks_line_ends_an_open_line_first(capsys: pytest.CaptureFixture[str]) -> None:
    console = ConsoleSink()
    for line in (LogLine(0, Stream.STDOUT, "ab", more=True), LogLine(1, Stream.STDOUT, "x"),
                 LogLine(0, Stream.STDOUT, "cd")):
        console.write(line)
    assert capsys.readouterr().out == "[0]<stdout>:ab\n[1]<stdout>:x\n[0]<stdout>:cd\n"
