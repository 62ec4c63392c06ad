"""TensorFlow's inter-op thread pool, wide enough for a graph's independent collectives.

Each collective inside a TensorFlow 1-style graph holds one of TensorFlow's inter-op threads until every
rank has issued it, and such a graph's independent collectives start in any order: a rank whose pool is
full of waiting collectives cannot issue the one its peer waits for. TensorFlow reads
``TF_NUM_INTEROP_THREADS`` when it builds its pools (the first session, or the first eager op), so
:func:`widen` sets it when ``phalanx.tensorflow`` is imported, unless the user set it, and ``hvd.init()``
never narrows the pool. Idle threads cost nothing measurable (a Keras fit on 2 cores took the same time with
2 and 64). A user's smaller pool (the variable, or ``tf.config.threading.set_inter_op_parallelism_threads``)
is kept, with one warning when the first collective enters a TensorFlow 1-style graph
(:func:`check_graph_pool`): ``tf.function`` graphs run their collectives in program order and need no
spare threads. Such a rank that runs out of threads is reported as blocked after the stall-warning time,
as any rank that issues nothing more.
"""

from __future__ import annotations

import os
import warnings

import tensorflow as tf

GRAPH_INTEROP_THREADS = 64
_ENV = "TF_NUM_INTEROP_THREADS"
_WARNED = [False]


def widen() -> None:
    """Set ``TF_NUM_INTEROP_THREADS`` to ``GRAPH_INTEROP_THREADS`` (or the core count, if larger) unless set."""
    os.environ.setdefault(_ENV, str(max(GRAPH_INTEROP_THREADS, os.cpu_count() or 1)))


def graph_pool() -> int:
    """The inter-op threads a TensorFlow 1-style session gets: TensorFlow's setting when one was made, else
    ``TF_NUM_INTEROP_THREADS`` (0: unknown, TensorFlow's own default)."""
    configured = tf.config.threading.get_inter_op_parallelism_threads()
    if configured:
        return int(configured)
    value = os.environ.get(_ENV, "").strip()
    return int(value) if value.isdigit() else 0


def check_graph_pool() -> None:
    """Warn once when a collective is added to a TensorFlow 1-style graph while the inter-op pool is
    narrower than ``GRAPH_INTEROP_THREADS`` (a ``tf.function``'s collectives run in order: no warning)."""
    if _WARNED[0] or tf.compat.v1.executing_eagerly_outside_functions():
        return
    threads = graph_pool()
    if 0 < threads < GRAPH_INTEROP_THREADS:
        _WARNED[0] = True
        warnings.warn(
            f"TensorFlow's inter-op pool has {threads} threads ({_ENV} or tf.config.threading): a TensorFlow "
            f"1-style graph whose Session.run has more than {threads} independent collectives can leave every "
            "thread of a rank waiting for a collective its peer has not started, and the ranks then fail as "
            f"blocked after HOROVOD_STALL_CHECK_TIME_SECONDS. Leave {_ENV} unset (phalanx sets "
            f"{GRAPH_INTEROP_THREADS}) or chain the collectives with tf.control_dependencies",
            RuntimeWarning, stacklevel=3,
        )
