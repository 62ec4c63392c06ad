"""The picture: communication against time, one lane per rank and per tensor, colored by activity.

Read it top to bottom: each rank's first lane ("rank N: all") overlays all of that rank's operations,
so gaps (computation) and long negotiations (waiting for another rank) show at a glance; the lanes below
are the busiest tensors and buckets. The time axis is shared by all ranks.
"""

from __future__ import annotations

import math
import os
import zlib
from collections.abc import Sequence
from dataclasses import dataclass

from phalanx.timeline import activities
from phalanx.timeline.png import GLYPH_W, Canvas, Color, text_width
from phalanx.timeline.reader import Span

WIDTH = 1400
LABEL_W = 270
MARGIN = 16
LANE_H = 14
RANK_LANE_H = 20
MAX_TENSOR_LANES = 40
GRID: Color = (225, 225, 225)
STRIPE: Color = (246, 246, 250)
INK: Color = (30, 30, 30)

COLORS: dict[str, Color] = {
    activities.NEGOTIATE_ALLREDUCE: (243, 178, 74),
    activities.NEGOTIATE_ALLGATHER: (238, 160, 60),
    activities.NEGOTIATE_BROADCAST: (232, 145, 50),
    activities.NEGOTIATE_ALLTOALL: (226, 130, 40),
    activities.NEGOTIATE_REDUCESCATTER: (220, 118, 32),
    activities.QUEUE: (185, 185, 185),
    activities.MEMCPY_IN_FUSION_BUFFER: (150, 210, 130),
    activities.MEMCPY_OUT_FUSION_BUFFER: (60, 150, 60),
    activities.ALLREDUCE: (52, 101, 164),
    activities.ALLGATHER: (117, 80, 173),
    activities.BROADCAST: (214, 39, 40),
    activities.ALLTOALL: (23, 170, 190),
    activities.REDUCESCATTER: (140, 86, 75),
    activities.WAIT_FOR_DATA: (250, 215, 70),
    activities.WAIT_FOR_OTHER_TENSOR_DATA: (235, 200, 110),
    activities.BARRIER: (90, 90, 90),
}


def color_of(activity: str) -> Color:
    """The activity's color (a stable made-up one for names phalanx does not know)."""
    known = COLORS.get(activity)
    if known is not None:
        return known
    h = zlib.crc32(activity.encode())
    return (60 + h % 160, 60 + (h >> 8) % 160, 60 + (h >> 16) % 160)


@dataclass(frozen=True)
class Lane:
    """One horizontal lane of the picture."""

    label: str
    spans: tuple[Span, ...]
    height: int


def _draw_order(s: Span) -> int:
    # Waits underneath, data movement on top, so a transfer inside a long wait stays visible.
    return 1 if s.name in activities.DATA_MOVING else 0


def lanes(spans: Sequence[Span], max_tensor_lanes: int = MAX_TENSOR_LANES) -> list[Lane]:
    """Per rank: an overview lane, then its busiest tensor lanes; the rest folded into one lane."""
    by_row: dict[tuple[int, str], list[Span]] = {}
    for s in spans:
        by_row.setdefault((s.pid, s.row), []).append(s)
    busiest = sorted(by_row, key=lambda k: -sum(s.dur_us for s in by_row[k]))
    shown = set(busiest[:max_tensor_lanes])
    folded = [s for k in busiest[max_tensor_lanes:] for s in by_row[k]]
    out: list[Lane] = []
    for pid in sorted({s.pid for s in spans}):
        mine = sorted((s for s in spans if s.pid == pid), key=_draw_order)
        out.append(Lane(f"rank {pid}: all", tuple(mine), RANK_LANE_H))
        for key in sorted(k for k in shown if k[0] == pid):
            out.append(Lane(f"  {key[1]}", tuple(sorted(by_row[key], key=_draw_order)), LANE_H))
    if folded:
        n = len(busiest) - max_tensor_lanes
        out.append(Lane(f"({n} more lanes)", tuple(sorted(folded, key=_draw_order)), LANE_H))
    return out


def _nice_step(span_us: float, ticks: int = 8) -> float:
    raw = max(span_us / ticks, 1e-3)
    mag = 10.0 ** math.floor(math.log10(raw))
    return next(mag * m for m in (1, 2, 5, 10) if mag * m >= raw)


def _tick_label(t_us: float, step_us: float) -> str:
    if step_us >= 1e6:
        return f"{t_us / 1e6:g} s"
    if step_us >= 1e3:
        return f"{t_us / 1e3:g} ms"
    return f"{t_us:g} us"


class _Frame:
    """Maps trace time to pixels."""

    def __init__(self, t0: float, t1: float) -> None:
        self.t0 = t0
        self.span = max(t1 - t0, 1e-6)
        self.x0 = LABEL_W
        self.width = WIDTH - LABEL_W - MARGIN

    def x(self, t_us: float) -> int:
        return self.x0 + int((t_us - self.t0) / self.span * self.width)


def _legend(canvas: Canvas | None, names: Sequence[str], y: int) -> int:
    """Draw (or, with no canvas, only measure) the legend from y; return the y below it."""
    x = MARGIN
    for name in names:
        w = 14 + text_width(name) + 16
        if x + w > WIDTH - MARGIN:
            x, y = MARGIN, y + 14
        if canvas is not None:
            canvas.rect(x, y, x + 10, y + 10, color_of(name))
            canvas.text(x + 14, y + 2, name, INK)
        x += w
    return y + 22


def _draw_labels(canvas: Canvas, rows: Sequence[Lane], y: int) -> None:
    room = (LABEL_W - 8) // GLYPH_W
    for i, lane in enumerate(rows):
        if i % 2:
            canvas.rect(0, y, WIDTH, y + lane.height, STRIPE)
        canvas.text(MARGIN // 2, y + (lane.height - 7) // 2, lane.label[:room], INK)
        y += lane.height


def _draw_bars(canvas: Canvas, frame: _Frame, rows: Sequence[Lane], y: int) -> None:
    for lane in rows:
        for s in lane.spans:
            x0 = frame.x(s.start_us)
            canvas.rect(x0, y + 2, max(x0 + 1, frame.x(s.end_us)), y + lane.height - 2, color_of(s.name))
        y += lane.height


def _draw_axis(canvas: Canvas, frame: _Frame, top: int, bottom: int) -> None:
    step = _nice_step(frame.span)
    k = 0
    while k * step <= frame.span:
        x = frame.x(frame.t0 + k * step)
        canvas.rect(x, top, x + 1, bottom + 4, GRID)
        label = _tick_label(k * step, step)
        canvas.text(max(0, x - text_width(label) // 2), bottom + 6, label, INK)
        k += 1


def render_png(spans: Sequence[Span], path: str, title: str = "phalanx timeline") -> None:
    """Draw ``spans`` as a PNG at ``path``.

    Raises:
        OSError: ``path`` cannot be written.
    """
    rows = lanes(spans)
    present = {s.name for s in spans}
    names = [a for a in activities.ALL_ACTIVITIES if a in present] + sorted(present - set(activities.ALL_ACTIVITIES))
    lanes_top = _legend(None, names, 40)
    height = lanes_top + sum(lane.height for lane in rows) + 30
    canvas = Canvas(WIDTH, height)
    t0 = min((s.start_us for s in spans), default=0.0)
    t1 = max((s.end_us for s in spans), default=1.0)
    frame = _Frame(t0, t1)
    canvas.text(MARGIN, 8, title, INK, scale=2)
    canvas.text(MARGIN, 28, f"{len(spans)} operations over {(t1 - t0) / 1e6:.3f} s", INK)
    _legend(canvas, names, 40)
    _draw_labels(canvas, rows, lanes_top)
    _draw_axis(canvas, frame, lanes_top, height - 30)
    _draw_bars(canvas, frame, rows, lanes_top)
    canvas.save(path)


def default_title(paths: Sequence[str]) -> str:
    """``phalanx timeline: name.json`` (or the first name and a count)."""
    first = os.path.basename(paths[0]) if paths else "?"
    more = f" (+{len(paths) - 1} files)" if len(paths) > 1 else ""
    return f"phalanx timeline: {first}{more}"
