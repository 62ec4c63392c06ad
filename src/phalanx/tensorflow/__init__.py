"""Horovod's TensorFlow API on phalanx.torch's collectives: ``import phalanx.tensorflow as hvd``.

Needs the optional extra ``phalanx[tensorflow]``. Topology and lifecycle are phalanx.torch's (one state per
process); ``allreduce`` / ``allgather`` / ``broadcast`` take TF tensors, eagerly or inside ``tf.function``
(through ``tf.numpy_function``, so not under XLA: ``jit_compile=False``). The Keras API is
``phalanx.tensorflow.keras``. See ``docs/tensorflow.md``.
"""

from __future__ import annotations

import importlib.util

if importlib.util.find_spec("tensorflow") is None:
    raise ImportError("phalanx.tensorflow needs TensorFlow, which is not installed: pip install 'phalanx[tensorflow]'")

from phalanx.tensorflow.basics import init
from phalanx.tensorflow.compression import Compression
from phalanx.tensorflow.ops import (
    allgather,
    allreduce,
    broadcast,
    broadcast_variables,
    grouped_allreduce,
)
from phalanx.torch import (
    Adasum,
    Average,
    Max,
    Min,
    ProcessSet,
    Product,
    Sum,
    cross_rank,
    cross_size,
    global_process_set,
    is_homogeneous,
    is_initialized,
    local_rank,
    local_size,
    mpi_built,
    mpi_enabled,
    mpi_threads_supported,
    rank,
    shutdown,
    size,
    start_timeline,
    stop_timeline,
)

__all__ = [
    "Adasum", "Average", "Compression", "Max", "Min", "ProcessSet", "Product", "Sum", "allgather", "allreduce",
    "broadcast", "broadcast_variables", "cross_rank", "cross_size", "global_process_set", "grouped_allreduce",
    "init", "is_homogeneous", "is_initialized", "local_rank", "local_size", "mpi_built", "mpi_enabled",
    "mpi_threads_supported", "rank", "shutdown", "size", "start_timeline", "stop_timeline",
]  # fmt: skip
