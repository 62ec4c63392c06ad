"""The numbers behind a trace: per activity and tensor, and per rank (who waits, who is waited for)."""

from __future__ import annotations

import re
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from phalanx.timeline.activities import ALL_ACTIVITIES, DATA_MOVING
from phalanx.timeline.reader import Span, Trace

ALL_TENSORS = "(all tensors)"


@dataclass(frozen=True)
class Row:
    """Aggregate of one activity on one tensor (or on all tensors: ``tensor == ALL_TENSORS``).

    Attributes:
        activity: e.g. ``ALLREDUCE``.
        tensor: the row's name, or :data:`ALL_TENSORS` for the activity's total.
        count: number of operations.
        nbytes: sum of their ``bytes`` args.
        total_us: sum of their durations, microseconds.
    """

    activity: str
    tensor: str
    count: int
    nbytes: int
    total_us: float

    @property
    def mean_us(self) -> float:
        """Mean duration, microseconds."""
        return self.total_us / self.count if self.count else 0.0

    @property
    def gbps(self) -> float | None:
        """Effective bandwidth, GB/s (1e9 bytes): bytes over time; None for activities that move no data."""
        if self.activity not in DATA_MOVING or self.nbytes <= 0 or self.total_us <= 0:
            return None
        return self.nbytes / self.total_us / 1e3


@dataclass(frozen=True)
class RankRow:
    """Time one rank spent per kind of activity, microseconds."""

    rank: int
    ops: int
    negotiate_us: float
    transfer_us: float
    wait_us: float


def _activity_order(activity: str) -> tuple[int, str]:
    known = ALL_ACTIVITIES.index(activity) if activity in ALL_ACTIVITIES else len(ALL_ACTIVITIES)
    return (known, activity)


def summarize(spans: Sequence[Span]) -> dict[str, list[Row]]:
    """Aggregate spans per activity and tensor.

    Returns:
        activity -> rows, activities in Horovod's pipeline order; each list starts with the activity's
        :data:`ALL_TENSORS` total, then its tensors by total time, longest first.
    """
    acc: dict[tuple[str, str], list[float]] = {}
    seen: set[tuple[int, str, float, float]] = set()
    for s in spans:
        a = acc.setdefault((s.name, s.row), [0, 0, 0.0])
        a[0] += 1
        a[1] += s.nbytes
        a[2] += s.dur_us
        whole = acc.setdefault((s.name, ALL_TENSORS), [0, 0, 0.0])
        whole[1] += s.nbytes
        if _first_of_fusion(s, seen):  # a fused operation shown on each of its tensors' rows counts once
            whole[0] += 1
            whole[2] += s.dur_us
    table: dict[str, list[Row]] = {}
    for (activity, tensor), (count, nbytes, total) in acc.items():
        table.setdefault(activity, []).append(Row(activity, tensor, int(count), int(nbytes), total))
    for rows in table.values():
        rows.sort(key=lambda r: (r.tensor != ALL_TENSORS, -r.total_us, natural_key(r.tensor)))
    return {a: table[a] for a in sorted(table, key=_activity_order)}


def _first_of_fusion(span: Span, seen: set[tuple[int, str, float, float]]) -> bool:
    """False for a copy of a fused operation already seen: Horovod's timeline (and phalanx's) shows one
    operation on several tensors as the same event (rank, activity, start, duration) on each tensor's row."""
    key = (span.pid, span.name, span.start_us, span.dur_us)
    if key in seen:
        return False
    seen.add(key)
    return True


def per_rank(spans: Sequence[Span]) -> list[RankRow]:
    """Time per rank in negotiation (waiting for the other ranks), data transfer and other waits (a fused
    operation counted once)."""
    acc: dict[int, list[float]] = {}
    seen: set[tuple[int, str, float, float]] = set()
    for s in spans:
        if not _first_of_fusion(s, seen):
            continue
        a = acc.setdefault(s.pid, [0, 0.0, 0.0, 0.0])
        a[0] += 1
        if s.name.startswith("NEGOTIATE"):
            a[1] += s.dur_us
        elif s.name in DATA_MOVING:
            a[2] += s.dur_us
        else:
            a[3] += s.dur_us
    return [RankRow(r, int(a[0]), a[1], a[2], a[3]) for r, a in sorted(acc.items())]


def straggler(ranks: Sequence[RankRow]) -> int | None:
    """The rank the others wait for, if one stands out: it negotiates far less than the median rank.

    In a collective every rank waits in negotiation until the last one arrives, so the last one (the
    straggler) barely waits at all.
    """
    if len(ranks) < 2:
        return None
    waits = [r.negotiate_us for r in ranks]
    median = statistics.median(waits)
    fastest = min(ranks, key=lambda r: r.negotiate_us)
    if median > 1000.0 and fastest.negotiate_us < 0.5 * median:
        return fastest.rank
    return None


def _ms(us: float) -> str:
    return f"{us / 1000:.3f}"


def _size(nbytes: int) -> str:
    if nbytes <= 0:
        return "-"
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if nbytes >= scale:
            return f"{nbytes / scale:.2f} {unit}"
    return f"{nbytes} B"


def _fit(text: str, width: int) -> str:
    """``text`` in ``width`` characters, shortened in the middle: a tensor's op and its last part (the
    layer, the step number) both stay readable."""
    if len(text) <= width:
        return text
    tail = (width - 3) // 2
    return text[: width - 3 - tail] + "..." + text[len(text) - tail:]


def natural_key(text: str) -> tuple[tuple[int, int | str], ...]:
    """Sort key that orders the numbers in names as numbers (``noname.2`` before ``noname.10``)."""
    return tuple((0, int(part)) if part.isdigit() else (1, part) for part in re.split(r"(\d+)", text) if part)


def render_table(table: dict[str, list[Row]], top: int = 10) -> str:
    """Format :func:`summarize`'s result; at most ``top`` tensors per activity (0: all)."""
    titles = ("activity", "tensor", "count", "bytes", "total ms", "mean ms", "GB/s")
    widths = ("<26", "<34", ">7", ">10", ">11", ">9", ">7")
    head = " ".join(format(t, w) for t, w in zip(titles, widths))
    out = [head, "-" * len(head)]
    for activity, rows in table.items():
        shown = rows if top <= 0 else rows[: top + 1]
        for r in shown:
            gbps = f"{r.gbps:.3f}" if r.gbps is not None else "-"
            out.append(
                f"{_fit(activity, 26):<26} {_fit(r.tensor, 34):<34} {r.count:>7} {_size(r.nbytes):>10} "
                f"{_ms(r.total_us):>11} {_ms(r.mean_us):>9} {gbps:>7}"
            )
        if len(rows) > len(shown):
            out.append(f"{'':<26} ... {len(rows) - len(shown)} more tensors (--top 0 shows all)")
    return "\n".join(out)


def render_ranks(ranks: Sequence[RankRow]) -> str:
    """Format :func:`per_rank`'s result, naming the straggler when one stands out."""
    out = [f"{'rank':>4} {'ops':>7} {'negotiate ms':>13} {'transfer ms':>12} {'other wait ms':>14}"]
    for r in ranks:
        times = f"{_ms(r.negotiate_us):>13} {_ms(r.transfer_us):>12} {_ms(r.wait_us):>14}"
        out.append(f"{r.rank:>4} {r.ops:>7} {times}")
    slow = straggler(ranks)
    if slow is not None:
        out.append(f"rank {slow} negotiates least: the other ranks wait for it (likely straggler)")
    return "\n".join(out)


def render(trace: Trace, top: int = 10) -> str:
    """The full text report of ``phalanx timeline summarize``."""
    spans = trace.spans
    if not spans:
        return f"no finished operations in the trace ({len(trace.events)} events)"
    window_s = (max(s.end_us for s in spans) - min(s.start_us for s in spans)) / 1e6
    ranks = per_rank(spans)
    cycles = sum(1 for ev in trace.instants if ev.get("name") == "CYCLE_START")
    lines = [
        f"{len(spans)} operations, {len(ranks)} rank(s), {window_s:.3f} s window"
        + (f", {cycles} cycles" if cycles else ""),
        "",
        render_table(summarize(spans), top),
    ]
    # Per-rank numbers only mean something for phalanx's layout (pid = rank), not Horovod's (pid = tensor).
    by_rank = all(trace.process_names.get(r.rank, "").startswith("rank ") for r in ranks)
    if len(ranks) > 1 and by_rank:
        lines += ["", render_ranks(ranks)]
    return "\n".join(lines)
