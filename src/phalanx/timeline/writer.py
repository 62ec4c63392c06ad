"""The Chrome-trace writer: a cheap recording path and a background thread that writes batches.

Recording (:meth:`Timeline.begin` / :meth:`Timeline.end`, called from any thread) takes a clock reading
and appends one tuple to a ``deque``; no formatting, no I/O, no lock (``dict`` and ``deque`` operations are
atomic). A daemon thread wakes every ``flush_interval_s``, formats what was recorded as complete Chrome
``"X"`` events, one JSON object per line followed by ``",\\n"``, writes the batch with one ``write`` and
flushes. So at any moment the file is a valid Chrome trace in the JSON-array format (whose closing bracket
is optional) that already holds every operation finished before the last flush.

Bounded growth is by rotation: when the current file would exceed half of ``max_bytes`` it is closed
(with its ``]``), renamed to ``<path>.1`` (replacing the previous one) and a new ``<path>`` is started with
the row names repeated, so the two files together never exceed ``max_bytes`` and each is a complete trace.
Memory is bounded too: at most ``max_pending`` events wait for the writer; beyond that they are dropped
and counted (:attr:`Timeline.dropped`).
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import IO

from phalanx.env import files
from phalanx.errors import TimelineError
from phalanx.timeline.activities import CYCLE_START

_log = logging.getLogger(__name__)
_now_ns = time.perf_counter_ns

DEFAULT_MAX_BYTES = 1024 * 1024 * 1024
#: Seconds between the writer's flushes: an operation is in the file at most this long after it returned
#: (Horovod's own test reads the file 0.1 s after an allreduce). An idle wake-up costs a few microseconds.
DEFAULT_FLUSH_INTERVAL_S = 0.02
DEFAULT_MAX_PENDING = 1_000_000
_ARGS_CACHE_SIZE = 4096

_SPAN = 0
_INSTANT = 1
_CYCLE = 2
_GROUP = 3

# (kind, tensor, name, start_ns, end_ns, begin_args, end_args); a _GROUP record is one operation on several
# rows (a fused bucket's tensors): tensor is a tuple of rows, start_ns an int or one per row, begin_args None
# or one dict per row, expanded into one line per row by the writer thread.
_Record = tuple[int, "str | tuple[str, ...]", str, "int | tuple[int, ...]", int,
                "dict[str, object] | tuple[dict[str, object] | None, ...] | None", "dict[str, object] | None"]


def clock_ns() -> int:
    """The timeline's clock (monotonic, nanoseconds): for a start taken before :meth:`Timeline.spans`."""
    return _now_ns()


_encode = json.JSONEncoder(separators=(",", ":"), default=str).encode


def _dumps(obj: object) -> str:
    return _encode(obj)


class _Formatter:
    """Turns records into trace lines; owns the tensor -> row (``tid``) table. Writer thread only."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self._tids: dict[str, int] = {}
        self._names: dict[str, str] = {}
        self._prefixes: dict[tuple[str, str], str] = {}
        self._args_cache: dict[tuple[tuple[str, object], ...], str] = {}
        # Anchor the monotonic clock to the wall clock once, so that traces of several ranks (or hosts
        # with synchronized clocks) share one time axis and ``ts`` never jumps backwards.
        self._wall0_ns = time.time_ns()
        self._mono0_ns = _now_ns()

    def ts_us(self, t_ns: int) -> str:
        return f"{(self._wall0_ns + t_ns - self._mono0_ns) / 1000:.3f}"

    def header(self) -> list[str]:
        """The metadata lines that start every file: process name and every row name seen so far."""
        # Horovod's header carries the origin of its relative ``ts``; phalanx's ``ts`` are since the epoch,
        # so the origin is 0 and tools that add it to ``ts`` (as for Horovod's files) get the right time.
        name = {"name": f"rank {self.rank}", "start_time_since_epoch_in_micros": 0}
        lines = [f'{{"name":"process_name","ph":"M","pid":{self.rank},"args":{_dumps(name)}}},\n']
        lines.extend(self._thread_line(tensor, tid) for tensor, tid in self._tids.items())
        return lines

    def footer(self) -> str:
        """The last line of a closed file: a metadata event without a trailing comma, and ``]``."""
        sort = f'{{"sort_index":{self.rank}}}'
        return f'{{"name":"process_sort_index","ph":"M","pid":{self.rank},"args":{sort}}}\n]\n'

    def _thread_line(self, tensor: str, tid: int) -> str:
        args = _dumps({"name": tensor})
        return f'{{"name":"thread_name","ph":"M","pid":{self.rank},"tid":{tid},"args":{args}}},\n'

    def _row(self, tensor: str, out: list[str]) -> int:
        tid = self._tids.get(tensor)
        if tid is None:
            tid = self._tids[tensor] = len(self._tids) + 1
            out.append(self._thread_line(tensor, tid))
        return tid

    def _name(self, name: str) -> str:
        quoted = self._names.get(name)
        if quoted is None:
            quoted = self._names[name] = _dumps(name)
        return quoted

    def _args(self, args: dict[str, object]) -> str:
        # Training repeats the same args (bucket, dtype, shape, bytes) every step: cache their JSON.
        try:
            key = tuple(args.items())
            cached = self._args_cache.get(key)
        except TypeError:  # an unhashable value (a list): format it every time
            return self._format_args(args)
        if cached is None:
            if len(self._args_cache) >= _ARGS_CACHE_SIZE:
                self._args_cache.clear()
            cached = self._args_cache[key] = self._format_args(args)
        return cached

    def _format_args(self, args: dict[str, object]) -> str:
        # Formatting the usual args (dtype, shape, bytes) by hand is cheaper than json.dumps of a small dict.
        parts = []
        for key, value in args.items():
            if type(value) is str:
                text = self._name(value)
            elif type(value) is int:
                text = str(value)
            elif isinstance(value, (tuple, list)) and all(type(v) is int for v in value):  # shapes, Size
                text = "[" + ",".join(map(str, value)) + "]"
            else:
                text = _dumps(value)
            parts.append(f"{self._name(key)}:{text}")
        return "{" + ",".join(parts) + "}"

    def format(self, rec: _Record, out: list[str]) -> None:
        """Append the line(s) for one record to ``out``."""
        kind, tensor, name, t0, t1, args0, args1 = rec
        if kind == _GROUP:
            assert isinstance(tensor, tuple) and not isinstance(args0, dict)
            for j, row in enumerate(tensor):
                start = t0[j] if isinstance(t0, tuple) else t0
                self.format((_SPAN, row, name, start, t1, args0[j] if args0 else None, args1), out)
            return
        assert isinstance(tensor, str) and isinstance(t0, int) and not isinstance(args0, tuple)
        pid = self.rank
        if kind == _CYCLE:
            out.append(f'{{"name":"{CYCLE_START}","ph":"i","s":"p","ts":{self.ts_us(t0)},"pid":{pid}}},\n')
            return
        prefix = self._prefixes.get((tensor, name))
        if prefix is None:
            tid = self._row(tensor, out)
            prefix = self._prefixes[(tensor, name)] = f'{{"name":{self._name(name)},"pid":{pid},"tid":{tid},"ts":'
        head = prefix + self.ts_us(t0)
        if kind == _INSTANT:
            out.append(f'{head},"ph":"i","s":"t"}},\n')
            return
        args = {**args0, **args1} if args0 and args1 else (args0 or args1)
        tail = f',"args":{self._args(args)}' if args else ""
        out.append(f'{head},"ph":"X","dur":{(t1 - t0) / 1000:.3f}{tail}}},\n')


class _TraceFile:
    """The open trace file and its rotation. Writer thread only (and the constructor, at start)."""

    def __init__(self, path: str, formatter: _Formatter, max_bytes: int) -> None:
        self.path = path
        self._fmt = formatter
        self._segment_bytes = max_bytes // 2 if max_bytes > 0 else 0
        self._file: IO[str] = self._open()
        self._size = 0
        self._header_bytes = 0
        self._write_header()

    def _open(self) -> IO[str]:
        try:
            # never through a link or into a FIFO planted in a shared directory; closed by close() or _rotate()
            fd = files.open_path(self.path, "the timeline file (--timeline-filename, HOROVOD_TIMELINE)")
            f = os.fdopen(fd, "w", encoding="utf-8")
            f.write("[\n")
            f.flush()
        except OSError as e:
            raise TimelineError(
                f"cannot write the timeline file {self.path!r}: {e.strerror or e}. Choose a path in an "
                "existing, writable directory (HOROVOD_TIMELINE, --timeline-filename or "
                "hvd.start_timeline(path))."
            ) from e
        return f

    def _write(self, text: str) -> None:
        self._file.write(text)
        self._file.flush()
        self._size += len(text)

    def write(self, text: str) -> None:
        """Write one batch of whole lines, rotating before any line that would take the file past its segment
        size. A batch can be larger than a segment (the writer thread runs late under load), so it is split at
        line ends rather than written whole; a segment always takes at least one line past its header."""
        if not self._segment_bytes or self._size + len(text) <= self._segment_bytes:
            self._write(text)
            return
        chunk: list[str] = []
        size = self._size
        for line in text.splitlines(keepends=True):
            if size + len(line) > self._segment_bytes and size > self._header_bytes:
                self._write("".join(chunk))
                chunk = []
                self._rotate()
                size = self._size
            chunk.append(line)
            size += len(line)
        self._write("".join(chunk))

    def _rotate(self) -> None:
        self._file.write(self._fmt.footer())
        self._file.close()
        os.replace(self.path, self.path + ".1")
        self._file = self._open()
        self._size = 0
        self._write_header()

    def _write_header(self) -> None:
        header = "".join(self._fmt.header())
        self._write(header)
        self._header_bytes = self._size

    def close(self) -> None:
        """Close the file with a final metadata event and ``]`` so that strict JSON parsers read it."""
        self._file.write(self._fmt.footer())
        self._file.close()


class Timeline:
    """One process's timeline: records operations and writes them to a Chrome trace.

    Create it with :func:`phalanx.timeline.start_timeline`, not directly. Every method is thread-safe.

    Args:
        path: the trace file (truncated).
        rank: this process's rank: the trace's ``pid``.
        mark_cycles: honour :meth:`mark_cycle` (otherwise it does nothing).
        max_bytes: rotation cap for this rank's trace, both segments together; 0 means unbounded.
        flush_interval_s: seconds between the writer thread's flushes (how stale the file may be).
        max_pending: events that may wait for the writer before new ones are dropped.

    Attributes:
        dropped: events dropped because ``max_pending`` were waiting.
        unmatched: ``end`` calls without a ``begin``.
        writer_cpu_s: CPU seconds the writer thread has used (formatting and writing), for cost accounting.

    Raises:
        TimelineError: the file cannot be created or written (raised here, at start).
    """

    def __init__(
        self,
        path: str,
        *,
        rank: int = 0,
        mark_cycles: bool = False,
        max_bytes: int = DEFAULT_MAX_BYTES,
        flush_interval_s: float = DEFAULT_FLUSH_INTERVAL_S,
        max_pending: int = DEFAULT_MAX_PENDING,
    ) -> None:
        self._fmt = _Formatter(rank)
        self._file = _TraceFile(path, self._fmt, max_bytes)
        self.path = path
        self.rank = rank
        self.mark_cycles = mark_cycles
        self.dropped = 0
        self.unmatched = 0
        self.writer_cpu_s = 0.0
        self._max_pending = max_pending
        self._interval_s = flush_interval_s
        self._open: dict[tuple[str, str], tuple[int, dict[str, object] | None]] = {}
        self._groups: dict[tuple[str, str], tuple[int, tuple[str, ...], tuple[dict[str, object] | None, ...]]] = {}
        self._pending: deque[_Record] = deque()
        self._stop = threading.Event()
        self._failed: OSError | None = None
        self._owner_pid = os.getpid()
        self._thread = threading.Thread(target=self._run, name="phalanx-timeline-writer", daemon=True)
        self._thread.start()

    @property
    def recording(self) -> bool:
        """True while events are recorded (False once stopped, or on a rank that does not record)."""
        return not self._stop.is_set()

    def begin(self, tensor_name: str, activity: str, args: dict[str, object] | None = None) -> None:
        """Start ``activity`` on the row of ``tensor_name`` (a tensor or bucket).

        ``args`` (e.g. dtype, shape, bytes) go to the trace; they are formatted later by the writer thread,
        so do not mutate the dict afterwards.
        """
        self._open[(tensor_name, activity)] = (_now_ns(), args)

    def end(self, tensor_name: str, activity: str, args: dict[str, object] | None = None) -> None:
        """Finish the ``activity`` begun on ``tensor_name``; ``args`` are merged into the begin's args.

        An ``end`` without a matching ``begin`` is counted in :attr:`unmatched` and otherwise ignored.
        """
        now = _now_ns()
        started = self._open.pop((tensor_name, activity), None)
        if started is None:
            self.unmatched += 1
            return
        self._push((_SPAN, tensor_name, activity, started[0], now, started[1], args))

    def begin_all(self, key: str, rows: tuple[str, ...], activity: str,
                  args: tuple[dict[str, object] | None, ...] = (), start_ns: int | None = None) -> None:
        """Start ``activity`` on every row of ``rows`` at once (one operation on several tensors: a fused
        bucket, as Horovod's timeline shows a fusion on each of its tensors); ``key`` names the operation for
        :meth:`end_all`. ``args``: one dict per row, or empty. Costs what :meth:`begin` costs, whatever the
        number of rows: the writer thread writes one line per row. ``start_ns``: when it started
        (:func:`clock_ns`), if not now."""
        self._groups[(key, activity)] = (_now_ns() if start_ns is None else start_ns, rows, args)

    def end_all(self, key: str, activity: str) -> None:
        """Finish the ``activity`` begun by :meth:`begin_all` under ``key`` (unmatched: counted, ignored)."""
        now = _now_ns()
        started = self._groups.pop((key, activity), None)
        if started is None:
            self.unmatched += 1
            return
        t0, rows, args = started
        self._push((_GROUP, rows, activity, t0, now, args or None, None))

    def spans(self, rows: tuple[str, ...], activity: str, starts: tuple[int, ...],
              args: tuple[dict[str, object] | None, ...] = ()) -> None:
        """Record ``activity`` on each row from its own start (:func:`clock_ns`) until now, e.g. each
        tensor's wait in a bucket's ``QUEUE`` since its gradient was ready; one record for all rows."""
        self._push((_GROUP, rows, activity, starts, _now_ns(), args or None, None))

    def instant(self, tensor_name: str, name: str) -> None:
        """Record an instant event called ``name`` on the row of ``tensor_name``."""
        self._push((_INSTANT, tensor_name, name, _now_ns(), 0, None, None))

    def mark_cycle(self) -> None:
        """Record a ``CYCLE_START`` marker across this rank's rows, if started with ``mark_cycles``."""
        if self.mark_cycles:
            self._push((_CYCLE, "", CYCLE_START, _now_ns(), 0, None, None))

    def _push(self, rec: _Record) -> None:
        if len(self._pending) >= self._max_pending:
            self.dropped += 1
            return
        self._pending.append(rec)

    def close(self) -> None:
        """Stop recording, write what is pending, and close the file (idempotent).

        In a forked child (a DataLoader worker) it only stops recording: the file belongs to the parent.
        """
        if self._stop.is_set():
            return
        if os.getpid() != self._owner_pid:
            self._max_pending = 0
            self._stop.set()
            return
        self._max_pending = 0
        self._stop.set()
        self._thread.join()
        if self._failed is None:
            self._guarded(self._file.close)

    def _run(self) -> None:
        while not self._stop.wait(self._interval_s):
            self._drain()
            self.writer_cpu_s = time.thread_time()
        self._drain()
        self.writer_cpu_s = time.thread_time()

    def _drain(self) -> None:
        lines: list[str] = []
        pending = self._pending
        for _ in range(len(pending)):
            self._fmt.format(pending.popleft(), lines)
        if lines and self._failed is None:
            text = "".join(lines)
            self._guarded(lambda: self._file.write(text))

    def _guarded(self, action: Callable[[], None]) -> None:
        # A disk that fills up mid-run must not crash training: log once, stop writing, keep going.
        try:
            action()
        except OSError as e:
            self._failed = e
            _log.warning("phalanx timeline: writing %s failed (%s); the timeline stops here", self.path, e)
