from __future__ import annotations

import io
import re
from pathlib import Path

import pytest

from phalanx.job.logs import ConsoleSink, FileSink, TailBuffer, pump_lines
from phalanx.job.records import LogLine, Stream


def test_pump_keeps_long_lines_whole_and_the_last_line_without_newline() -> None:
    data = b"first\n" + b"y" * 100_000 + b"\n" + "caf\u00e9".encode() + b"\nno newline"
    got: list[LogLine] = []
    pump_lines(io.BytesIO(data), 3, Stream.STDOUT, got.append)
    assert [g.text for g in got] == ["first", "y" * 100_000, "caf\u00e9", "no newline"]
    assert {g.rank for g in got} == {3}


def test_console_prefix_like_horovodrun(capsys: pytest.CaptureFixture[str]) -> None:
    sink = ConsoleSink()
    sink.write(LogLine(1, Stream.STDOUT, "out"))
    sink.write(LogLine(0, Stream.STDERR, "err"))
    ConsoleSink(prefix=False).write(LogLine(0, Stream.STDOUT, "bare"))
    captured = capsys.readouterr()
    assert captured.out == "[1]<stdout>:out\nbare\n"
    assert captured.err == "[0]<stderr>:err\n"


def test_file_sink_layout(tmp_path: Path) -> None:
    sink = FileSink(tmp_path)
    sink.write(LogLine(0, Stream.STDOUT, "a"))
    sink.write(LogLine(1, Stream.STDERR, "b"))
    sink.close()
    assert (tmp_path / "rank.0" / "stdout").read_text() == "a\n"
    assert (tmp_path / "rank.1" / "stderr").read_text() == "b\n"


def test_tail_is_bounded() -> None:
    tail = TailBuffer(lines=3)
    for i in range(10):
        tail.write(LogLine(0, Stream.STDOUT, str(i)))
    tail.write(LogLine(0, Stream.STDOUT, "z" * 5000))
    got = tail.tail(0)
    assert got[:2] == ("8", "9") and got[2].startswith("z" * 1000) and "4000 more characters" in got[2]
    assert tail.tail(7) == ()


def test_console_renders_carriage_returns_and_spaces_a_bare_timestamp(capsys: pytest.CaptureFixture[str]) -> None:
    from phalanx.job.logs import render_carriage_returns

    assert render_carriage_returns("1/3 [==>   ] loss 0.9\r2/3 [=====>] loss 0.5\r3/3 [done]") == \
        "3/3 [done]>] loss 0.5"  # as a terminal: the last state over what it did not overwrite
    ConsoleSink().write(LogLine(rank=1, stream=Stream.STDOUT, text="1/2 [=>  ]\r2/2 [===]\r"))
    ConsoleSink(prefix=False, timestamp=True).write(LogLine(rank=0, stream=Stream.STDOUT, text="hello"))
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "[1]<stdout>:2/2 [===]]"  # the longer first state shows through, as in a terminal
    assert re.fullmatch(r"\w{3} \w{3} [ \d]\d \d\d:\d\d:\d\d \d{4} hello", out[1]), out[1]
