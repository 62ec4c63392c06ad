"""``horovod.tensorflow.mpi_ops``: the ops module scripts import from, with Horovod's names.

Besides the collectives (defined in ``ops`` and ``collectives``), it has the graph ops that read the topology
when the graph runs, not when it is built (``rank_op``, ``size_op``, ...), ``join`` and Horovod's helpers.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import tensorflow as tf

import phalanx.torch as ptorch
from phalanx.errors import InvalidArgumentError
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
from phalanx.tensorflow.ops import allreduce, grouped_allreduce
from phalanx.tensorflow.tf_types import Gradient
from phalanx.torch import frontend as reduce_ops
from phalanx.torch import process_sets
from phalanx.torch.basics import (
    ccl_built,
    cross_rank,
    cross_size,
    cuda_built,
    ddl_built,
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
    rocm_built,
    shutdown,
    size,
    start_timeline,
    stop_timeline,
)
from phalanx.torch.frontend import add_process_set, remove_process_set
from phalanx.torch.process_sets import ProcessSet, global_process_set

Average, Sum, Adasum = reduce_ops.Average, reduce_ops.Sum, reduce_ops.Adasum
Min, Max, Product = reduce_ops.Min, reduce_ops.Max, reduce_ops.Product

# Horovod's process-set error codes (horovod/common/basics.py), returned by process_set_included_op.
HOROVOD_PROCESS_SET_ERROR_INIT = -1
HOROVOD_PROCESS_SET_ERROR_UNKNOWN_SET = -3


def handle_average_backwards_compatibility(op: int | None, average: bool | None) -> int:
    """Horovod's rule for the deprecated ``average``: True -> Average, False -> Sum, default Average.

    Raises:
        ValueError: both ``op`` and ``average`` were given.
    """
    return reduce_ops.resolve_op(op, average)


def check_num_rank_power_of_2(num_rank: int) -> bool:
    """Whether ``num_rank`` is a power of two (Adasum's requirement in Horovod)."""
    return num_rank > 0 and num_rank & (num_rank - 1) == 0


def _scalar_op(fn: Callable[[], int], name: str | None) -> tf.Tensor:
    """An int32 scalar computed by ``fn`` when the graph runs (eagerly: now)."""
    if tf.executing_eagerly():
        return tf.constant(fn(), dtype=tf.int32)
    out = tf.numpy_function(lambda: np.int32(fn()), [], Tout=tf.int32, stateful=True, name=name or "phalanx_scalar")
    out.set_shape([])
    return out


def _set_by_id(process_set_id: int) -> ProcessSet | None:
    if process_set_id == 0:
        return global_process_set
    return process_sets.registered(process_set_id)


def _set_size(process_set_id: int) -> int:
    found = _set_by_id(process_set_id)
    if found is None:
        raise InvalidArgumentError(f"size_op: no process set with id {process_set_id} is registered")
    return found.size()


def _included(process_set_id: int) -> int:
    if not is_initialized():
        return HOROVOD_PROCESS_SET_ERROR_INIT
    found = _set_by_id(process_set_id)
    if found is None:
        return HOROVOD_PROCESS_SET_ERROR_UNKNOWN_SET
    return int(found.included())


def rank_op(name: str | None = None) -> tf.Tensor:
    """This process's rank, read when the graph runs."""
    return _scalar_op(rank, name)


def local_rank_op(name: str | None = None) -> tf.Tensor:
    """This process's rank within its host, read when the graph runs."""
    return _scalar_op(local_rank, name)


def size_op(process_set_id: int = 0, name: str | None = None) -> tf.Tensor:
    """The number of ranks in the process set (0: the global set), read when the graph runs."""
    return _scalar_op(lambda: _set_size(process_set_id), name)


def local_size_op(name: str | None = None) -> tf.Tensor:
    """The number of ranks on this host, read when the graph runs."""
    return _scalar_op(local_size, name)


def process_set_included_op(process_set_id: int = 0, name: str | None = None) -> tf.Tensor:
    """1 if this process belongs to the set, 0 if not; ``HOROVOD_PROCESS_SET_ERROR_INIT`` (-1) before
    ``init``, ``HOROVOD_PROCESS_SET_ERROR_UNKNOWN_SET`` (-3) for an unknown id (Horovod's codes)."""
    return _scalar_op(lambda: _included(process_set_id), name)


def join() -> tf.Tensor:
    """Mark this rank as done with its data; returns (as an int32 scalar) the last rank that joined.

    Until every rank has joined, a joined rank takes part in the others' single-tensor allreduces with
    zeros (see ``phalanx.torch.join``); inside a graph it runs when the graph runs.
    """
    return _scalar_op(ptorch.join, "phalanx_join")


def _allreduce(tensor: object, name: str | None = None, op: int = Sum, prescale_factor: float = 1.0,
               postscale_factor: float = 1.0, ignore_name_scope: bool = False,
               process_set: ProcessSet = global_process_set) -> tf.Tensor:
    """Horovod's raw allreduce op (default ``Sum``), which the public ``allreduce`` wraps."""
    return allreduce(tensor, op=op, prescale_factor=prescale_factor, postscale_factor=postscale_factor, name=name,
                     process_set=process_set, ignore_name_scope=ignore_name_scope)


def _grouped_allreduce(tensors: Sequence[object], name: str | None = None, op: int = Sum,
                       prescale_factor: float = 1.0, postscale_factor: float = 1.0, ignore_name_scope: bool = False,
                       process_set: ProcessSet = global_process_set) -> list[Gradient]:
    """Horovod's raw grouped allreduce op (default ``Sum``)."""
    return grouped_allreduce(tensors, op=op, prescale_factor=prescale_factor, postscale_factor=postscale_factor,
                             process_set=process_set, ignore_name_scope=ignore_name_scope, name=name)


def _reducescatter(tensor: object, name: str | None = None, op: int = Sum, ignore_name_scope: bool = False,
                   process_set: ProcessSet = global_process_set) -> tf.Tensor:
    """Horovod's raw reducescatter op (default ``Sum``)."""
    return reducescatter(tensor, op=op, name=name, process_set=process_set, ignore_name_scope=ignore_name_scope)


def _grouped_reducescatter(tensors: Sequence[object], name: str | None = None, op: int = Sum,
                           ignore_name_scope: bool = False,
                           process_set: ProcessSet = global_process_set) -> list[tf.Tensor]:
    """Horovod's raw grouped reducescatter op (default ``Sum``)."""
    del name, ignore_name_scope
    return grouped_reducescatter(tensors, op=op, process_set=process_set)


__all__ = [
    "HOROVOD_PROCESS_SET_ERROR_INIT",
    "HOROVOD_PROCESS_SET_ERROR_UNKNOWN_SET",
    "Adasum",
    "Average",
    "Max",
    "Min",
    "ProcessSet",
    "Product",
    "Sum",
    "_allreduce",
    "_grouped_allreduce",
    "_grouped_reducescatter",
    "_reducescatter",
    "add_process_set",
    "allgather",
    "alltoall",
    "broadcast",
    "broadcast_",
    "ccl_built",
    "check_num_rank_power_of_2",
    "cross_rank",
    "cross_size",
    "cuda_built",
    "ddl_built",
    "global_process_set",
    "gloo_built",
    "gloo_enabled",
    "grouped_allgather",
    "handle_average_backwards_compatibility",
    "init",
    "is_homogeneous",
    "is_initialized",
    "join",
    "local_rank",
    "local_rank_op",
    "local_size",
    "local_size_op",
    "mpi_built",
    "mpi_enabled",
    "mpi_threads_supported",
    "nccl_built",
    "process_set_included_op",
    "rank",
    "rank_op",
    "remove_process_set",
    "rocm_built",
    "shutdown",
    "size",
    "size_op",
    "start_timeline",
    "stop_timeline",
]
