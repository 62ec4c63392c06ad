"""The process's active timeline: start, stop, and start from the Horovod environment variables.

Horovod semantics: rank 0 writes the trace (its view of the job). With ``all_ranks`` (or
``PHALANX_TIMELINE_ALL_RANKS=1``) every rank writes its own file, ``timeline.json`` becoming
``timeline.rank0.json``, ``timeline.rank1.json``, ... with ``pid`` = rank, so that the merged trace shows one
process per rank and the rank that makes the others wait stands out. A rank that does not record gets a
:class:`NullTimeline` and :func:`current` stays ``None`` there, so instrumented code costs one call and one
``is None`` test.
"""

from __future__ import annotations

import atexit
import os
import threading

from phalanx.env import names as env_names
from phalanx.env import settings
from phalanx.timeline.writer import DEFAULT_MAX_BYTES, Timeline

#: ``HOROVOD_TIMELINE=DYNAMIC``: Horovod's "do not start now; hvd.start_timeline() will".
DYNAMIC = "DYNAMIC"

_lock = threading.Lock()
_active: Timeline | None = None
_atexit_registered = False


class NullTimeline(Timeline):
    """The timeline of a rank that does not record: every method does nothing."""

    def __init__(self, path: str, rank: int) -> None:  # no file, no thread
        self.path = path
        self.rank = rank
        self.mark_cycles = False
        self.dropped = 0
        self.unmatched = 0
        self.writer_cpu_s = 0.0

    @property
    def recording(self) -> bool:
        """Always False."""
        return False

    def begin(self, tensor_name: str, activity: str, args: dict[str, object] | None = None) -> None:
        """Do nothing."""

    def end(self, tensor_name: str, activity: str, args: dict[str, object] | None = None) -> None:
        """Do nothing."""

    def begin_all(self, key: str, rows: tuple[str, ...], activity: str,
                  args: tuple[dict[str, object] | None, ...] = (), start_ns: int | None = None) -> None:
        """Do nothing."""

    def end_all(self, key: str, activity: str) -> None:
        """Do nothing."""

    def spans(self, rows: tuple[str, ...], activity: str, starts: tuple[int, ...],
              args: tuple[dict[str, object] | None, ...] = ()) -> None:
        """Do nothing."""

    def instant(self, tensor_name: str, name: str) -> None:
        """Do nothing."""

    def mark_cycle(self) -> None:
        """Do nothing."""

    def close(self) -> None:
        """Do nothing."""


def current() -> Timeline | None:
    """The process's recording timeline, or None when the timeline is off (or this rank does not record)."""
    return _active


def max_bytes_from_env() -> int:
    """The rotation cap from ``PHALANX_TIMELINE_MAX_MB`` (megabytes; 0 = unbounded), default 1024 MB."""
    if not settings.TIMELINE_MAX_MB.is_set():
        return DEFAULT_MAX_BYTES
    return int(settings.TIMELINE_MAX_MB.get() * 1024 * 1024)


def rank_path(path: str, rank: int) -> str:
    """The file rank ``rank`` writes in every-rank mode: ``t.json`` -> ``t.rank1.json``."""
    root, ext = os.path.splitext(path)
    return f"{root}.rank{rank}{ext}"


def start_timeline(
    file_path: str,
    mark_cycles: bool = False,
    *,
    all_ranks: bool | None = None,
    max_bytes: int | None = None,
) -> Timeline:
    """Start recording this process's collectives to a Chrome trace (``hvd.start_timeline``).

    Rank and size come from the worker contract (``RANK`` / ``WORLD_SIZE``; 0 / 1 outside a job). A timeline
    already running is stopped first.

    Args:
        file_path: the trace file; truncated. In every-rank mode each rank writes :func:`rank_path`.
        mark_cycles: record ``CYCLE_START`` markers (Horovod's ``HOROVOD_TIMELINE_MARK_CYCLES``).
        all_ranks: every rank writes its own view; default ``PHALANX_TIMELINE_ALL_RANKS``, else rank 0 only.
        max_bytes: rotation cap per rank (both segments); default ``PHALANX_TIMELINE_MAX_MB`` or 1024 MB.

    Returns:
        The recording :class:`Timeline`, or a :class:`NullTimeline` on a rank that does not record.

    Raises:
        TimelineError: the file cannot be written (a missing or read-only directory) - at start, never later.
        InvalidArgumentError: a malformed ``RANK`` or ``PHALANX_TIMELINE_MAX_MB``.
    """
    global _active
    rank = settings.first_int(os.environ, env_names.RANK, default=0)
    every = settings.TIMELINE_ALL_RANKS.get() if all_ranks is None else all_ranks
    cap = max_bytes_from_env() if max_bytes is None else max_bytes
    with _lock:
        _stop_locked()
        if rank != 0 and not every:
            return NullTimeline(file_path, rank)
        path = rank_path(file_path, rank) if every else file_path
        _active = Timeline(path, rank=rank, mark_cycles=mark_cycles, max_bytes=cap)
        _register_atexit()
        return _active


def stop_timeline() -> None:
    """Stop the active timeline: write what is pending and close the file. Does nothing when off."""
    with _lock:
        _stop_locked()


def _stop_locked() -> None:
    global _active
    tl, _active = _active, None
    if tl is not None:
        tl.close()


def _register_atexit() -> None:
    # Flush the last events when the interpreter exits normally (hvd.shutdown should stop it earlier).
    global _atexit_registered
    if not _atexit_registered:
        atexit.register(stop_timeline)
        _atexit_registered = True


def _forget_in_child() -> None:
    # A forked child (e.g. a DataLoader worker) must neither record into nor close the parent's trace.
    global _active
    tl, _active = _active, None
    if tl is not None:
        tl.close()  # in a child this only stops recording


os.register_at_fork(after_in_child=_forget_in_child)


def start_from_env() -> Timeline | None:
    """Start the timeline the environment asks for (called by ``hvd.init()``).

    ``HOROVOD_TIMELINE=path`` starts it (``DYNAMIC`` or unset: nothing starts);
    ``HOROVOD_TIMELINE_MARK_CYCLES=1`` adds cycle markers. Calling it again while the same file is being
    written returns the running timeline rather than truncating it.

    Returns:
        The timeline started (a :class:`NullTimeline` on ranks that do not record), or None.

    Raises:
        TimelineError: the path cannot be written.
    """
    path = settings.TIMELINE.get()
    if not path or path.upper() == DYNAMIC:
        return None
    running = _active
    every = settings.TIMELINE_ALL_RANKS.get()
    if running is not None and running.path in (path, rank_path(path, running.rank) if every else path):
        return running
    return start_timeline(path, mark_cycles=settings.TIMELINE_MARK_CYCLES.get())
