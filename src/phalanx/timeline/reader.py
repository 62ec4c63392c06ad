"""Read Chrome traces - including ones still being written - into spans.

Accepted: the JSON-array format with or without its closing bracket and with a trailing comma (how
phalanx and Horovod leave a trace while the job runs), a last line cut short by a concurrent write (it is
ignored), and the object format ``{"traceEvents": [...]}``. Durations come from complete ``"X"`` events
(phalanx) and from ``"B"``/``"E"`` pairs (Horovod), matched per row like Chrome does.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from phalanx.errors import TimelineError

Event = dict[str, Any]


@dataclass(frozen=True)
class Span:
    """One finished operation on one row.

    Attributes:
        pid: the trace's process: the rank for phalanx traces.
        tid: the row within the process (one per tensor or bucket).
        row: the row's name: the tensor or bucket name.
        name: the activity, e.g. ``ALLREDUCE``.
        start_us: start, microseconds on the trace's clock.
        dur_us: duration in microseconds.
        args: the event's args (``dtype``, ``shape``, ``bytes``, ...).
    """

    pid: int
    tid: int
    row: str
    name: str
    start_us: float
    dur_us: float
    args: dict[str, Any] = field(default_factory=dict)

    @property
    def end_us(self) -> float:
        """End, microseconds on the trace's clock."""
        return self.start_us + self.dur_us

    @property
    def nbytes(self) -> int:
        """The ``bytes`` arg; else ``shape`` x the size of ``dtype``; else 0."""
        value = self.args.get("bytes")
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return int(value)
        shape, size = self.args.get("shape"), dtype_size(self.args.get("dtype"))
        if isinstance(shape, list) and size and all(isinstance(d, int) for d in shape):
            return math.prod(shape) * size
        return 0


_DTYPE_SIZES = {
    "float64": 8, "double": 8, "float32": 4, "float": 4, "float16": 2, "half": 2, "bfloat16": 2,
    "int64": 8, "long": 8, "int32": 4, "int": 4, "int16": 2, "short": 2, "int8": 1, "uint8": 1, "bool": 1,
    "complex64": 8, "complex128": 16,
}


def dtype_size(dtype: object) -> int | None:
    """Bytes per element of a dtype named like ``torch.float32`` or ``float32``; None when unknown."""
    return _DTYPE_SIZES.get(str(dtype).removeprefix("torch.")) if dtype is not None else None


def inherit_args(spans: Sequence[Span]) -> list[Span]:
    """Give a span without ``bytes`` or ``shape`` the args of the previous span on its row.

    Producers often describe a tensor once per operation: phalanx.torch puts dtype and shape on the
    negotiation and bytes on the bucket copy, not on the collective that follows on the same row.
    """
    last: dict[tuple[int, int], dict[str, Any]] = {}
    out: list[Span] = []
    for s in sorted(spans, key=lambda s: s.start_us):
        key = (s.pid, s.tid)
        prev = last.get(key)
        if prev and "bytes" not in s.args and "shape" not in s.args:
            s = Span(s.pid, s.tid, s.row, s.name, s.start_us, s.dur_us, {**prev, **s.args})
        if "bytes" in s.args or "shape" in s.args:
            last[key] = s.args
        out.append(s)
    return out


@dataclass
class Trace:
    """Everything read from one or more trace files.

    Attributes:
        events: every event, in file order.
        spans: every finished operation, sorted by start.
        instants: instant events (``"i"``/``"I"``), e.g. ``CYCLE_START``.
        process_names: pid -> name (``"rank 0"``).
    """

    events: list[Event]
    spans: list[Span]
    instants: list[Event]
    process_names: dict[int, str]


def _parse_lines(text: str, source: str) -> list[Event]:
    lines = [ln.strip().rstrip(",") for ln in text.splitlines()]
    lines = [ln for ln in lines if ln and ln not in ("[", "]")]
    events: list[Event] = []
    for i, line in enumerate(lines):
        try:
            obj = json.loads(line.rstrip("]").rstrip().rstrip(","))
        except json.JSONDecodeError as e:
            if i == len(lines) - 1:
                break  # the writer is in the middle of this line
            raise TimelineError(f"{source}: event {i + 1} is not JSON ({e}); is this a Chrome trace?") from e
        if isinstance(obj, dict):
            events.append(obj)
    return events


def parse_events(text: str, source: str = "<trace>") -> list[Event]:
    """Parse a Chrome trace's text into its events, tolerating an array that is still open.

    Raises:
        TimelineError: the text is not a Chrome trace.
    """
    body = text.strip()
    if not body:
        return []
    if body.startswith("{"):
        try:
            obj = json.loads(body)
        except json.JSONDecodeError as e:
            raise TimelineError(f"{source}: not a JSON trace ({e})") from e
        return [ev for ev in obj.get("traceEvents", []) if isinstance(ev, dict)]
    if not body.startswith("["):
        raise TimelineError(f"{source}: a Chrome trace starts with '[' or '{{'; found {body[:20]!r}")
    closed = body if body.endswith("]") else body.rstrip(",") + "]"
    try:
        parsed = json.loads(closed)
    except json.JSONDecodeError:
        return _parse_lines(body, source)  # a trailing comma before ']', or a line cut short
    return [ev for ev in parsed if isinstance(ev, dict)]


def load_events(path: str) -> list[Event]:
    """Read one trace file's events (see :func:`parse_events`).

    Raises:
        TimelineError: the file cannot be read or is not a Chrome trace.
    """
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as e:
        raise TimelineError(f"cannot read the trace {path!r}: {e.strerror or e}") from e
    return parse_events(text, path)


def _row_names(events: Iterable[Event]) -> tuple[dict[tuple[int, int], str], dict[int, str]]:
    threads: dict[tuple[int, int], str] = {}
    processes: dict[int, str] = {}
    for ev in events:
        if ev.get("ph") != "M":
            continue
        name = str(ev.get("args", {}).get("name", ""))
        if ev.get("name") == "thread_name":
            threads[(int(ev.get("pid", 0)), int(ev.get("tid", 0)))] = name
        elif ev.get("name") == "process_name":
            processes[int(ev.get("pid", 0))] = name
    return threads, processes


def spans_from_events(events: Sequence[Event]) -> tuple[list[Span], dict[int, str]]:
    """Pair the events into spans; return them (sorted by start, args inherited along rows: see
    :func:`inherit_args`) and the process names."""
    threads, processes = _row_names(events)
    open_: dict[tuple[int, int], list[Event]] = {}
    spans: list[Span] = []
    for ev in events:
        ph = ev.get("ph")
        if ph not in ("X", "B", "E"):
            continue
        key = (int(ev.get("pid", 0)), int(ev.get("tid", 0)))
        if ph == "B":
            open_.setdefault(key, []).append(ev)
            continue
        start = ev
        if ph == "E":
            stack = open_.get(key)
            if not stack:
                continue
            start = stack.pop()
        # Horovod puts each tensor in its own process (no thread names); phalanx in its own row.
        row = threads.get(key) or processes.get(key[0]) or f"pid {key[0]} tid {key[1]}"
        t0 = float(start.get("ts", 0.0))
        dur = float(ev.get("dur", 0.0)) if ph == "X" else float(ev.get("ts", t0)) - t0
        args = {**start.get("args", {}), **(ev.get("args", {}) if ph == "E" else {})}
        spans.append(Span(key[0], key[1], row, str(start.get("name", "?")), t0, dur, args))
    return inherit_args(spans), processes


def load_trace(paths: Sequence[str]) -> Trace:
    """Read and merge trace files (every rank's file, or a file and its rotated ``.1`` segment).

    Raises:
        TimelineError: a file cannot be read or is not a Chrome trace.
    """
    events: list[Event] = []
    for path in paths:
        events.extend(load_events(path))
    spans, processes = spans_from_events(events)
    instants = [ev for ev in events if ev.get("ph") in ("i", "I")]
    return Trace(events=events, spans=spans, instants=instants, process_names=processes)


def merge(paths: Sequence[str], out_path: str) -> int:
    """Write the events of several traces (e.g. every rank's) into one closed trace Chrome can open.

    Returns:
        The number of events written.

    Raises:
        TimelineError: a trace cannot be read or the output cannot be written.
    """
    events: list[Event] = []
    for path in paths:
        events.extend(load_events(path))
    try:
        with open(out_path, "w", encoding="utf-8") as f:
            f.write("[\n")
            f.write(",\n".join(json.dumps(ev, separators=(",", ":")) for ev in events))
            f.write("\n]\n")
    except OSError as e:
        raise TimelineError(f"cannot write the merged trace {out_path!r}: {e.strerror or e}") from e
    return len(events)
