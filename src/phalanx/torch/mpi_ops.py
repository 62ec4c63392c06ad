"""Horovod's ``horovod.torch.mpi_ops``: the collectives (synchronous ones differentiable), their autograd
Functions, and every other name Horovod's module has, so ``from horovod.torch.mpi_ops import ...`` works.

Backward passes are Horovod's (see ``_autograd``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from phalanx.errors import HorovodInternalError, InvalidArgumentError
from phalanx.torch import async_ops
from phalanx.torch._engine import reduce as reduction
from phalanx.torch._engine.reduce import Adasum, Average, Max, Min, Product, Sum
from phalanx.torch._setup.membership import add_process_set, remove_process_set
from phalanx.torch._train.autograd import (
    HorovodAllgather,
    HorovodAllreduce,
    HorovodAlltoall,
    HorovodBroadcast,
    HorovodGroupedAllgather,
    HorovodGroupedAllreduce,
    HorovodGroupedReducescatter,
    HorovodReducescatter,
)
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
from phalanx.torch.compression import Compression, Compressor
from phalanx.torch.process_sets import ProcessSet, global_process_set


def handle_average_backwards_compatibility(op: int | None, average: bool | None) -> int:
    """The op Horovod's deprecated ``average=`` flag stands for (``op`` itself when ``average`` is None).

    Raises:
        ValueError: both were given.
    """
    return reduction.resolve_op(op, average)


def get_average_backwards_compatibility_fun(reduce_ops: Any) -> Callable[[int | None, bool | None], int]:
    """Horovod's factory of :func:`handle_average_backwards_compatibility` (``reduce_ops`` is unused: phalanx
    has one set of op codes)."""
    del reduce_ops
    return handle_average_backwards_compatibility


def check_installed_version(name: str, version: str) -> None:
    """Horovod checks its compiled extension against the framework here; phalanx has none to check."""
    del name, version


def gpu_available(ext_base_name: str, verbose: bool = False) -> bool:
    """Whether a GPU is usable for ``ext_base_name`` (``"torch"``: ``torch.cuda.is_available()``)."""
    del ext_base_name, verbose
    return bool(torch.cuda.is_available())


def num_rank_is_power_2(num_rank: int) -> bool:
    """Whether ``num_rank`` is a power of two (Horovod's Adasum helper)."""
    return num_rank > 0 and num_rank & (num_rank - 1) == 0


def sparse_allreduce_async(tensor: torch.Tensor, name: str, op: int,
                           process_set: ProcessSet = global_process_set) -> Callable[[], torch.Tensor]:
    """Start the allreduce of a sparse COO tensor as two allgathers (its indices and its values), Horovod's
    way; returns a function that waits and returns the reduced sparse tensor (duplicate indices are summed
    when it is coalesced).

    Args:
        tensor: a sparse COO tensor (same dense shape on every member).
        name: the base name of the two allgathers (``<name>.indices``, ``<name>.values``).
        op: ``Average`` (values divided by the set size) or ``Sum``.
        process_set: the ranks taking part.

    Raises:
        ValueError: ``tensor`` is not sparse, or ``op`` is neither Average nor Sum.
    """
    if not tensor.is_sparse:
        raise InvalidArgumentError(f"sparse_allreduce_async needs a sparse COO tensor, got a {tensor.layout} one; "
                                   "use allreduce_async for dense tensors")
    if op not in (reduction.Average, reduction.Sum):
        raise InvalidArgumentError(
            f"sparse_allreduce_async supports op=hvd.Average or hvd.Sum, got {reduction.OP_NAMES.get(op, op)}")
    indices = async_ops.allgather_async(tensor._indices().transpose(0, 1).contiguous(), f"{name}.indices", process_set)
    values = async_ops.allgather_async(tensor._values().contiguous(), f"{name}.values", process_set)

    def wait() -> torch.Tensor:
        vals = async_ops.synchronize(values)
        idx = async_ops.synchronize(indices)
        if op == reduction.Average:
            vals = vals / process_set.size()
        return torch.sparse_coo_tensor(idx.transpose(0, 1), vals, tensor.size())

    return wait


@async_ops.runs_inline
def allreduce(
    tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
    compression: type[Compressor] = Compression.none, op: int | None = None, prescale_factor: float = 1.0,
    postscale_factor: float = 1.0, process_set: ProcessSet = global_process_set,
) -> torch.Tensor:
    """Allreduce ``tensor`` across the set and return the result in a new tensor (differentiable).

    Args:
        tensor: the tensor to reduce (same shape and dtype on every member).
        average: deprecated; True means ``op=Average``, False ``op=Sum``.
        name: optional name, shown in errors.
        compression: ``Compression.none`` or ``Compression.fp16`` (applied to the payload).
        op: ``Average`` (default), ``Sum``, ``Min``, ``Max`` or ``Product``.
        prescale_factor: multiply inputs by this before reducing.
        postscale_factor: multiply the result by this.
        process_set: the ranks taking part.

    Returns:
        The reduced tensor.

    Raises:
        ValueError: before ``hvd.init()`` or on bad arguments.
        CollectiveMismatchError: ranks disagree on shape, dtype, op, ... (RuntimeError, on every rank).
    """
    op_ = reduction.resolve_op(op, average)
    compressed, cctx = compression.compress(tensor)
    if _tracked(compressed):
        out = HorovodAllreduce.apply(compressed, None, name, op_, prescale_factor, postscale_factor, process_set)
    else:  # nothing to differentiate: skip autograd's Function machinery (a fixed cost per call)
        handle = async_ops.allreduce_async(compressed, None, name, op_, prescale_factor, postscale_factor, process_set)
        out = async_ops.synchronize(handle)
    return compression.decompress(out, cctx)


def _tracked(tensor: torch.Tensor) -> bool:
    """Whether autograd records an op on ``tensor`` (only then do the differentiable forms need a Function)."""
    return tensor.requires_grad and torch.is_grad_enabled()


@async_ops.runs_inline
def allreduce_(
    tensor: torch.Tensor, average: bool | None = None, name: str | None = None, op: int | None = None,
    prescale_factor: float = 1.0, postscale_factor: float = 1.0, process_set: ProcessSet = global_process_set,
) -> torch.Tensor:
    """In-place allreduce: ``tensor`` receives the result, which is also returned."""
    handle = async_ops.allreduce_async_(tensor, average, name, op, prescale_factor, postscale_factor, process_set)
    return async_ops.synchronize(handle)


@async_ops.runs_inline
def grouped_allreduce(
    tensors: Sequence[torch.Tensor], average: bool | None = None, name: str | None = None,
    compression: type[Compressor] = Compression.none, op: int | None = None, prescale_factor: float = 1.0,
    postscale_factor: float = 1.0, process_set: ProcessSet = global_process_set,
) -> list[torch.Tensor]:
    """Allreduce several tensors as one collective (one signature check); differentiable.

    Returns:
        The reduced tensors, in order.
    """
    op_ = reduction.resolve_op(op, average)
    packed = [compression.compress(t) for t in tensors]
    outs = HorovodGroupedAllreduce.apply(None, name, op_, prescale_factor, postscale_factor, process_set,
                                         *[p[0] for p in packed])
    return [compression.decompress(o, p[1]) for o, p in zip(outs, packed)]


@async_ops.runs_inline
def grouped_allreduce_(
    tensors: Sequence[torch.Tensor], average: bool | None = None, name: str | None = None,
    op: int | None = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
    process_set: ProcessSet = global_process_set,
) -> list[torch.Tensor]:
    """In-place grouped allreduce; returns the (updated) input tensors."""
    handle = async_ops.grouped_allreduce_async_(tensors, average, name, op, prescale_factor, postscale_factor,
                                                process_set)
    return async_ops.synchronize(handle)


@async_ops.runs_inline
def allgather(tensor: torch.Tensor, name: str | None = None,
              process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """Concatenate every member's tensor along dim 0 (first dimensions may differ); differentiable.

    Returns:
        A tensor whose dim 0 is the sum of the members' dim 0, in rank order.
    """
    return HorovodAllgather.apply(tensor, name, process_set)


@async_ops.runs_inline
def grouped_allgather(tensors: Sequence[torch.Tensor], name: str | None = None,
                      process_set: ProcessSet = global_process_set) -> list[torch.Tensor]:
    """Allgather each tensor; returns the list of results (differentiable)."""
    return list(HorovodGroupedAllgather.apply(name, process_set, *tensors))


@async_ops.runs_inline
def broadcast(tensor: torch.Tensor, root_rank: int, name: str | None = None,
              process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """Return ``root_rank``'s tensor (a global rank) on every member; differentiable."""
    if _tracked(tensor):
        return HorovodBroadcast.apply(tensor, root_rank, name, process_set)
    return async_ops.synchronize(async_ops.broadcast_async(tensor, root_rank, name, process_set))


@async_ops.runs_inline
def broadcast_(tensor: torch.Tensor, root_rank: int, name: str | None = None,
               process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """In-place broadcast: ``tensor`` receives ``root_rank``'s values and is returned."""
    return async_ops.synchronize(async_ops.broadcast_async_(tensor, root_rank, name, process_set))


@async_ops.runs_inline
def alltoall(tensor: torch.Tensor, splits: Sequence[int] | torch.Tensor | None = None, name: str | None = None,
             process_set: ProcessSet = global_process_set) -> Any:
    """Send ``splits[i]`` rows of ``tensor`` to the i-th member and receive theirs; differentiable.

    Args:
        tensor: rows to scatter (dim 0).
        splits: rows per destination (default: equal parts; dim 0 must then divide evenly).
        name: optional name.
        process_set: the ranks taking part.

    Returns:
        The received rows in member order; with ``splits`` given, ``(output, received_splits)`` (how many
        rows came from each member), as in Horovod.
    """
    return HorovodAlltoall.apply(tensor, splits, name, process_set)


@async_ops.runs_inline
def reducescatter(
    tensor: torch.Tensor, name: str | None = None, compression: type[Compressor] = Compression.none,
    op: int = reduction.Average, process_set: ProcessSet = global_process_set, prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
) -> torch.Tensor:
    """Reduce across members and return this member's slice of dim 0; differentiable.

    Returns:
        Rows ``[start, start + d0 // size (+1 for the first d0 % size members))`` of the reduced tensor.
    """
    compressed, cctx = compression.compress(tensor)
    out = HorovodReducescatter.apply(compressed, name, op, process_set, prescale_factor, postscale_factor)
    return compression.decompress(out, cctx)


@async_ops.runs_inline
def grouped_reducescatter(
    tensors: Sequence[torch.Tensor], name: str | None = None, compression: type[Compressor] = Compression.none,
    op: int = reduction.Average, process_set: ProcessSet = global_process_set, prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
) -> list[torch.Tensor]:
    """Reduce-scatter each tensor; returns the list of slices (differentiable)."""
    packed = [compression.compress(t) for t in tensors]
    outs = HorovodGroupedReducescatter.apply(name, op, process_set, prescale_factor, postscale_factor,
                                             *[p[0] for p in packed])
    return [compression.decompress(o, p[1]) for o, p in zip(outs, packed)]


__all__ = [
    "Adasum", "Average", "Compression", "HorovodAllgather", "HorovodAllreduce", "HorovodAlltoall",
    "HorovodBroadcast", "HorovodGroupedAllgather", "HorovodGroupedAllreduce", "HorovodGroupedReducescatter",
    "HorovodInternalError", "HorovodReducescatter", "Max", "Min", "ProcessSet", "Product", "Sum",
    "add_process_set", "allgather", "allgather_async", "allreduce", "allreduce_", "allreduce_async",
    "allreduce_async_", "alltoall", "alltoall_async", "barrier", "broadcast", "broadcast_", "broadcast_async",
    "broadcast_async_", "ccl_built", "check_installed_version", "cross_rank", "cross_size", "cuda_built",
    "ddl_built", "get_average_backwards_compatibility_fun", "global_process_set", "gloo_built", "gloo_enabled",
    "gpu_available", "grouped_allgather", "grouped_allgather_async", "grouped_allreduce", "grouped_allreduce_",
    "grouped_allreduce_async", "grouped_allreduce_async_", "grouped_reducescatter",
    "grouped_reducescatter_async", "handle_average_backwards_compatibility", "init", "is_homogeneous",
    "is_initialized", "join", "local_rank", "local_size", "mpi_built", "mpi_enabled", "mpi_threads_supported",
    "nccl_built", "num_rank_is_power_2", "poll", "rank", "reducescatter", "reducescatter_async",
    "remove_process_set", "rocm_built", "shutdown", "size", "sparse_allreduce_async", "start_timeline",
    "stop_timeline", "synchronize"
]
