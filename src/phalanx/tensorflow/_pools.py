"""TensorFlow's inter-op thread pool, wide enough for a graph's independent collectives.

Each collective inside a graph holds one of TensorFlow's inter-op threads until every rank has issued it,
and a TensorFlow 1 graph's independent collectives start in any order: with TensorFlow's default pool (one
thread per core) a rank can run out of threads before it issues the collective its peer waits for.
TensorFlow reads ``TF_NUM_INTEROP_THREADS`` when it builds its pools (the first session, or the first eager
op), so :func:`widen` sets it when ``phalanx.tensorflow`` is imported, unless the user set it. Idle threads
cost nothing measurable (a Keras fit on 2 cores took the same time with 2 and 64).
"""

from __future__ import annotations

import os

GRAPH_INTEROP_THREADS = 64


def widen() -> None:
    """Set ``TF_NUM_INTEROP_THREADS`` to ``GRAPH_INTEROP_THREADS`` (or the core count, if larger) unless set."""
    os.environ.setdefault("TF_NUM_INTEROP_THREADS", str(max(GRAPH_INTEROP_THREADS, os.cpu_count() or 1)))
