"""The Horovod API for PyTorch on ``torch.distributed``: ``import phalanx.torch as hvd``.

Gloo carries CPU tensors, NCCL CUDA tensors. Collectives run in the order each rank issues them (as in
``torch.distributed``); ranks that disagree on a collective get a ``RuntimeError`` on every rank. See
``docs/torch.md``.
"""

from __future__ import annotations

from phalanx.errors import HorovodInternalError
from phalanx.torch import elastic
from phalanx.torch._membership import add_process_set, remove_process_set
from phalanx.torch._reduce import Adasum, Average, Max, Min, Product, Sum
from phalanx.torch.async_ops import (
    allgather_async,
    allreduce_async,
    allreduce_async_,
    alltoall_async,
    barrier,
    broadcast_async,
    broadcast_async_,
    grouped_allgather_async,
    grouped_allreduce_async,
    grouped_allreduce_async_,
    grouped_reducescatter_async,
    join,
    poll,
    reducescatter_async,
    synchronize,
)
from phalanx.torch.basics import (
    ccl_built,
    cross_rank,
    cross_size,
    cuda_built,
    ddl_built,
    gloo_built,
    gloo_enabled,
    init,
    is_homogeneous,
    is_initialized,
    local_rank,
    local_size,
    mpi_built,
    mpi_enabled,
    mpi_threads_supported,
    nccl_built,
    rank,
    rocm_built,
    shutdown,
    size,
    start_timeline,
    stop_timeline,
)
from phalanx.torch.compression import Compression
from phalanx.torch.functions import (
    allgather_object,
    broadcast_object,
    broadcast_optimizer_state,
    broadcast_parameters,
)
from phalanx.torch.mpi_ops import (
    allgather,
    allreduce,
    allreduce_,
    alltoall,
    broadcast,
    broadcast_,
    grouped_allgather,
    grouped_allreduce,
    grouped_allreduce_,
    grouped_reducescatter,
    reducescatter,
    sparse_allreduce_async,
)
from phalanx.torch.optimizer import DistributedOptimizer
from phalanx.torch.process_sets import ProcessSet, global_process_set
from phalanx.torch.sync_batch_norm import SyncBatchNorm

__all__ = [
    "Adasum", "Average", "Compression", "DistributedOptimizer", "HorovodInternalError", "Max", "Min",
    "ProcessSet", "Product", "Sum", "SyncBatchNorm", "add_process_set", "allgather", "allgather_async",
    "allgather_object", "allreduce",
    "allreduce_", "allreduce_async", "allreduce_async_", "alltoall", "alltoall_async", "barrier", "broadcast",
    "broadcast_", "broadcast_async", "broadcast_async_", "broadcast_object", "broadcast_optimizer_state",
    "broadcast_parameters", "ccl_built", "cross_rank", "cross_size", "cuda_built", "ddl_built",
    "elastic", "global_process_set", "gloo_built", "gloo_enabled", "grouped_allgather", "grouped_allgather_async",
    "grouped_allreduce", "grouped_allreduce_", "grouped_allreduce_async", "grouped_allreduce_async_",
    "grouped_reducescatter", "grouped_reducescatter_async", "init", "is_homogeneous", "is_initialized", "join",
    "local_rank", "local_size", "mpi_built", "mpi_enabled", "mpi_threads_supported", "nccl_built", "poll",
    "rank", "reducescatter", "reducescatter_async", "remove_process_set", "rocm_built", "shutdown", "size",
    "sparse_allreduce_async", "start_timeline", "stop_timeline", "synchronize",
]
