"""The picture is a valid PNG that shows the operations; the CLI prints the table and writes the picture."""

from __future__ import annotations

import struct
import zlib
from pathlib import Path

import pytest

from phalanx.cli.tool import main
from phalanx.timeline import ALLREDUCE, NEGOTIATE_ALLREDUCE
from phalanx.timeline.plot import COLORS, lanes, render_png
from phalanx.timeline.png import Canvas
from phalanx.timeline.reader import Span
from phalanx.timeline.writer import Timeline


def _decode_png(data: bytes) -> tuple[int, int, bytes]:
    """Check signature, chunk CRCs and sizes; return width, height and the raw scanlines."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    pos, chunks = 8, []
    while pos < len(data):
        (length,) = struct.unpack(">I", data[pos : pos + 4])
        kind, body = data[pos + 4 : pos + 8], data[pos + 8 : pos + 8 + length]
        (crc,) = struct.unpack(">I", data[pos + 8 + length : pos + 12 + length])
        assert crc == zlib.crc32(kind + body) & 0xFFFFFFFF
        chunks.append((kind, body))
        pos += 12 + length
    assert [k for k, _ in chunks] == [b"IHDR", b"IDAT", b"IEND"]
    width, height, depth, color_type = struct.unpack(">IIBB", chunks[0][1][:10])
    assert (depth, color_type) == (8, 2)
    raw = zlib.decompress(chunks[1][1])
    assert len(raw) == height * (1 + 3 * width)
    return width, height, raw


def test_canvas_round_trip(tmp_path: Path) -> None:
    canvas = Canvas(7, 5)
    canvas.rect(2, 1, 4, 3, (10, 20, 30))
    canvas.text(0, 0, "Az?~", (1, 2, 3))
    path = tmp_path / "c.png"
    canvas.save(str(path))
    width, height, _ = _decode_png(path.read_bytes())
    assert (width, height) == (7, 5)
    assert canvas.pixel(3, 2) == (10, 20, 30) and canvas.pixel(6, 4) == (255, 255, 255)


def _spans() -> list[Span]:
    out = []
    for rank in (0, 1):
        for i in range(50):
            out.append(Span(rank, 1, "bucket.0", NEGOTIATE_ALLREDUCE, i * 1000.0, 300.0))
            out.append(Span(rank, 1, "bucket.0", ALLREDUCE, i * 1000.0 + 300, 500.0, {"bytes": 10}))
            out.append(Span(rank, 2 + i, f"grad.{i}", ALLREDUCE, i * 1000.0 + 900, 50.0))
    return out


def test_lanes_fold_the_quiet_tensors() -> None:
    rows = lanes(_spans(), max_tensor_lanes=5)
    assert [r.label for r in rows[:2]] == ["rank 0: all", "  bucket.0"]
    assert rows[-1].label == "(97 more lanes)"
    assert sum(len(r.spans) for r in rows if not r.label.startswith("rank")) == 300


def test_picture_shows_the_operations(tmp_path: Path) -> None:
    path = tmp_path / "p.png"
    render_png(_spans(), str(path))
    width, height, raw = _decode_png(path.read_bytes())
    assert width == 1400 and height > 200
    stride = 1 + 3 * width
    pixels = {bytes(raw[y * stride + 1 + 3 * x : y * stride + 4 + 3 * x]) for y in range(height) for x in range(width)}
    assert bytes(COLORS[ALLREDUCE]) in pixels and bytes(COLORS[NEGOTIATE_ALLREDUCE]) in pixels


def test_cli_summarize_and_plot(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = tmp_path / "t.json"
    tl = Timeline(str(trace))
    for _ in range(3):
        tl.begin("bucket.0", ALLREDUCE, {"bytes": 1_000_000})
        tl.end("bucket.0", ALLREDUCE)
    tl.close()
    png = tmp_path / "out.png"
    assert main(["timeline", "summarize", str(trace), "--plot", str(png)]) == 0
    out = capsys.readouterr().out
    assert "ALLREDUCE" in out and "bucket.0" in out and "3.00 MB" in out
    _decode_png(png.read_bytes())
    assert main(["timeline", "merge", str(tmp_path / "m.json"), str(trace)]) == 0


def test_cli_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["timeline", "summarize", str(tmp_path / "missing.json")]) == 1
    assert "cannot read the trace" in capsys.readouterr().err
    trace = tmp_path / "t.json"
    trace.write_text("[\n")
    assert main(["timeline", "summarize", str(trace), "--plot", str(tmp_path / "no" / "p.png")]) == 1
    assert "cannot write the picture" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["timeline"])
