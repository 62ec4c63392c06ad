"""Horovod-compatible timeline: a Chrome trace of every collective, readable while the job runs.

Start it with ``HOROVOD_TIMELINE=path`` (read by ``hvd.init()`` through :func:`start_from_env`),
``phalanxrun --timeline-filename path`` or ``hvd.start_timeline(path)``; open the file in
chrome://tracing or https://ui.perfetto.dev, or run ``phalanx timeline summarize path [--plot out.png]``.

Instrumented code (``phalanx.torch``) does::

    tl = timeline.current()
    if tl is not None:
        tl.begin(name, timeline.ALLREDUCE, {"dtype": ..., "shape": ..., "bytes": ...})
    ...
    if tl is not None:
        tl.end(name, timeline.ALLREDUCE)

This package imports only the standard library, :mod:`phalanx.env.names` and :mod:`phalanx.errors`.
See ``docs/timeline.md``.
"""

from __future__ import annotations

from phalanx.errors import TimelineError
from phalanx.timeline.activities import (
    ALL_ACTIVITIES,
    ALLGATHER,
    ALLREDUCE,
    ALLTOALL,
    BARRIER,
    BROADCAST,
    CYCLE_START,
    DATA_MOVING,
    MEMCPY_IN_FUSION_BUFFER,
    MEMCPY_OUT_FUSION_BUFFER,
    NEGOTIATE_ALLGATHER,
    NEGOTIATE_ALLREDUCE,
    NEGOTIATE_ALLTOALL,
    NEGOTIATE_BROADCAST,
    NEGOTIATE_REDUCESCATTER,
    QUEUE,
    REDUCESCATTER,
    WAIT_FOR_DATA,
    WAIT_FOR_OTHER_TENSOR_DATA,
)
from phalanx.timeline.control import (
    NullTimeline,
    current,
    rank_path,
    start_from_env,
    start_timeline,
    stop_timeline,
)
from phalanx.timeline.writer import Timeline, clock_ns

__all__ = [
    "ALLGATHER",
    "ALLREDUCE",
    "ALLTOALL",
    "ALL_ACTIVITIES",
    "BARRIER",
    "BROADCAST",
    "CYCLE_START",
    "DATA_MOVING",
    "MEMCPY_IN_FUSION_BUFFER",
    "MEMCPY_OUT_FUSION_BUFFER",
    "NEGOTIATE_ALLGATHER",
    "NEGOTIATE_ALLREDUCE",
    "NEGOTIATE_ALLTOALL",
    "NEGOTIATE_BROADCAST",
    "NEGOTIATE_REDUCESCATTER",
    "QUEUE",
    "REDUCESCATTER",
    "WAIT_FOR_DATA",
    "WAIT_FOR_OTHER_TENSOR_DATA",
    "NullTimeline",
    "Timeline",
    "TimelineError",
    "clock_ns",
    "current",
    "rank_path",
    "start_from_env",
    "start_timeline",
    "stop_timeline",
]
