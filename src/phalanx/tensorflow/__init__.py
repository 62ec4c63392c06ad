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

from phalanx.tensorflow import _pools, _session, elastic
from phalanx.tensorflow.basics import init
from phalanx.tensorflow.collectives import (
    allgather,
    alltoall,
    broadcast,
    broadcast_,
    grouped_allgather,
    grouped_reducescatter,
    reducescatter,
)
from phalanx.tensorflow.compression import Compression
from phalanx.tensorflow.functions import allgather_object, broadcast_object, broadcast_object_fn
from phalanx.tensorflow.gradient_aggregation import LocalGradientAggregationHelper
from phalanx.tensorflow.gradient_tape import DistributedGradientTape, PartialDistributedGradientTape
from phalanx.tensorflow.mpi_ops import (
    check_num_rank_power_of_2,
    handle_average_backwards_compatibility,
    join,
    local_rank_op,
    local_size_op,
    process_set_included_op,
    rank_op,
    size_op,
)
from phalanx.tensorflow.ops import allreduce, broadcast_variables, grouped_allreduce
from phalanx.tensorflow.optimizer import (
    BroadcastGlobalVariablesHook,
    DistributedOptimizer,
    broadcast_global_variables,
)
from phalanx.tensorflow.util import _executing_eagerly
from phalanx.torch import (
    Adasum,
    Average,
    Max,
    Min,
    ProcessSet,
    Product,
    Sum,
    add_process_set,
    ccl_built,
    cross_rank,
    cross_size,
    cuda_built,
    ddl_built,
    global_process_set,
    gloo_built,
    gloo_enabled,
    is_homogeneous,
    is_initialized,
    local_rank,
    local_size,
    mpi_built,
    mpi_enabled,
    mpi_threads_supported,
    nccl_built,
    rank,
    remove_process_set,
    rocm_built,
    shutdown,
    size,
    start_timeline,
    stop_timeline,
)

_pools.widen()
_session.install()


def __getattr__(name: str) -> object:
    # SyncBatchNormalization subclasses the BatchNormalization of the Keras tf.keras is, which TensorFlow
    # chooses (TF_USE_LEGACY_KERAS) at the first use of tf.keras: importing this package must not make that
    # choice (a warm-start template imports it before a rank's environment is set).
    if name == "SyncBatchNormalization":
        from phalanx.tensorflow.sync_batch_norm import SyncBatchNormalization

        return SyncBatchNormalization
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

__all__ = [
    "Adasum", "Average", "BroadcastGlobalVariablesHook", "Compression", "DistributedGradientTape",
    "DistributedOptimizer", "LocalGradientAggregationHelper", "Max", "Min", "PartialDistributedGradientTape",
    "ProcessSet", "Product", "Sum", "SyncBatchNormalization", "_executing_eagerly", "add_process_set", "allgather",
    "allgather_object", "allreduce", "alltoall", "broadcast", "broadcast_", "broadcast_global_variables",
    "broadcast_object",
    "broadcast_object_fn", "broadcast_variables", "ccl_built", "check_num_rank_power_of_2", "cross_rank",
    "cross_size", "cuda_built", "ddl_built", "elastic", "global_process_set", "gloo_built", "gloo_enabled",
    "grouped_allgather", "grouped_allreduce", "grouped_reducescatter", "handle_average_backwards_compatibility",
    "init", "is_homogeneous", "is_initialized", "join", "local_rank", "local_rank_op", "local_size",
    "local_size_op", "mpi_built", "mpi_enabled", "mpi_threads_supported", "nccl_built", "process_set_included_op",
    "rank", "rank_op", "reducescatter", "remove_process_set", "rocm_built", "shutdown", "size", "size_op",
    "start_timeline", "stop_timeline",
]
