"""Synchronous collectives, differentiable as in Horovod (``horovod.torch.mpi_ops``).

Backward passes (Horovod's definitions): allreduce -> allreduce of the gradient with the same op;
allgather -> averaged gradient, this rank's rows; broadcast -> averaged gradient on the root, zero
elsewhere; alltoall -> alltoall of the gradient back with the received splits; reducescatter ->
allgather of the gradient (divided by the set size for Average).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from phalanx.torch import _reduce as R
from phalanx.torch import async_ops as A
from phalanx.torch.compression import Compression, Compressor
from phalanx.torch.process_sets import ProcessSet, global_process_set


class _Allreduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, name: str | None, op: int, pre: float, post: float,
                ps: ProcessSet) -> torch.Tensor:  # fmt: skip
        ctx.args = (op, pre, post, ps)
        return A.synchronize(A.allreduce_async(tensor, None, name, op, pre, post, ps))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        op, pre, post, ps = ctx.args
        out = A.synchronize(A.allreduce_async(grad.contiguous(), None, None, op, pre, post, ps))
        return out, None, None, None, None, None


def allreduce(
    tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
    compression: type[Compressor] = Compression.none, op: int | None = None, prescale_factor: float = 1.0,
    postscale_factor: float = 1.0, process_set: ProcessSet = global_process_set,
) -> torch.Tensor:  # fmt: skip
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
    op_ = R.resolve_op(op, average)
    compressed, cctx = compression.compress(tensor)
    if _tracked(compressed):
        out = _Allreduce.apply(compressed, name, op_, prescale_factor, postscale_factor, process_set)
    else:  # nothing to differentiate: skip autograd's Function machinery (a fixed cost per call)
        out = A.synchronize(A.allreduce_async(compressed, None, name, op_, prescale_factor, postscale_factor,
                                              process_set))  # fmt: skip
    return compression.decompress(out, cctx)


def _tracked(tensor: torch.Tensor) -> bool:
    """Whether autograd records an op on ``tensor`` (only then do the differentiable forms need a Function)."""
    return tensor.requires_grad and torch.is_grad_enabled()


def allreduce_(
    tensor: torch.Tensor, average: bool | None = None, name: str | None = None, op: int | None = None,
    prescale_factor: float = 1.0, postscale_factor: float = 1.0, process_set: ProcessSet = global_process_set,
) -> torch.Tensor:  # fmt: skip
    """In-place allreduce: ``tensor`` receives the result, which is also returned."""
    return A.synchronize(A.allreduce_async_(tensor, average, name, op, prescale_factor, postscale_factor, process_set))


class _GroupedAllreduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, name: str | None, op: int, pre: float, post: float, ps: ProcessSet,
                *tensors: torch.Tensor) -> Any:  # fmt: skip
        ctx.args = (op, pre, post, ps)
        return tuple(A.synchronize(A.grouped_allreduce_async(list(tensors), None, name, op, pre, post, ps)))

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> Any:
        op, pre, post, ps = ctx.args
        out = A.synchronize(A.grouped_allreduce_async([g.contiguous() for g in grads], None, None, op, pre, post, ps))
        return (None, None, None, None, None, *out)


def grouped_allreduce(
    tensors: Sequence[torch.Tensor], average: bool | None = None, name: str | None = None,
    compression: type[Compressor] = Compression.none, op: int | None = None, prescale_factor: float = 1.0,
    postscale_factor: float = 1.0, process_set: ProcessSet = global_process_set,
) -> list[torch.Tensor]:  # fmt: skip
    """Allreduce several tensors as one collective (one signature check); differentiable.

    Returns:
        The reduced tensors, in order.
    """
    op_ = R.resolve_op(op, average)
    packed = [compression.compress(t) for t in tensors]
    outs = _GroupedAllreduce.apply(name, op_, prescale_factor, postscale_factor, process_set, *[p[0] for p in packed])
    return [compression.decompress(o, p[1]) for o, p in zip(outs, packed)]


def grouped_allreduce_(
    tensors: Sequence[torch.Tensor], average: bool | None = None, name: str | None = None,
    op: int | None = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
    process_set: ProcessSet = global_process_set,
) -> list[torch.Tensor]:  # fmt: skip
    """In-place grouped allreduce; returns the (updated) input tensors."""
    handle = A.grouped_allreduce_async_(tensors, average, name, op, prescale_factor, postscale_factor, process_set)
    return A.synchronize(handle)


class _Allgather(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, name: str | None, ps: ProcessSet) -> torch.Tensor:
        ctx.dim, ctx.ps = tensor.shape[0], ps
        return A.synchronize(A.allgather_async(tensor, name, ps))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        reduced = allreduce(grad.contiguous(), op=R.Average, process_set=ctx.ps)
        dims = A.synchronize(A.allgather_async(torch.tensor([ctx.dim]), None, ctx.ps))
        offset = int(dims[: ctx.ps.rank()].sum())
        return reduced.narrow(0, offset, ctx.dim), None, None


def allgather(tensor: torch.Tensor, name: str | None = None,
              process_set: ProcessSet = global_process_set) -> torch.Tensor:  # fmt: skip
    """Concatenate every member's tensor along dim 0 (first dimensions may differ); differentiable.

    Returns:
        A tensor whose dim 0 is the sum of the members' dim 0, in rank order.
    """
    return _Allgather.apply(tensor, name, process_set)


def grouped_allgather(tensors: Sequence[torch.Tensor], name: str | None = None,
                      process_set: ProcessSet = global_process_set) -> list[torch.Tensor]:  # fmt: skip
    """Allgather each tensor; returns the list of results."""
    return A.synchronize(A.grouped_allgather_async(tensors, name, process_set))


class _Broadcast(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, root: int, name: str | None, ps: ProcessSet) -> torch.Tensor:
        ctx.root, ctx.ps = root, ps
        return A.synchronize(A.broadcast_async(tensor, root, name, ps))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        from phalanx.torch._state import topology

        reduced = allreduce(grad.contiguous(), op=R.Average, process_set=ctx.ps)
        if topology().rank != ctx.root:
            reduced = reduced * 0
        return reduced, None, None, None


def broadcast(tensor: torch.Tensor, root_rank: int, name: str | None = None,
              process_set: ProcessSet = global_process_set) -> torch.Tensor:  # fmt: skip
    """Return ``root_rank``'s tensor (a global rank) on every member; differentiable."""
    if _tracked(tensor):
        return _Broadcast.apply(tensor, root_rank, name, process_set)
    return A.synchronize(A.broadcast_async(tensor, root_rank, name, process_set))


def broadcast_(tensor: torch.Tensor, root_rank: int, name: str | None = None,
               process_set: ProcessSet = global_process_set) -> torch.Tensor:  # fmt: skip
    """In-place broadcast: ``tensor`` receives ``root_rank``'s values and is returned."""
    return A.synchronize(A.broadcast_async_(tensor, root_rank, name, process_set))


class _Alltoall(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, splits: Any, name: str | None, ps: ProcessSet) -> Any:
        out, received = A.synchronize(A.alltoall_async(tensor, splits, name, ps))
        ctx.received, ctx.ps = received, ps
        ctx.mark_non_differentiable(received)
        return out, received

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor, _unused: Any) -> Any:
        back, _ = A.synchronize(A.alltoall_async(grad.contiguous(), ctx.received, None, ctx.ps))
        return back, None, None, None


def alltoall(tensor: torch.Tensor, splits: Sequence[int] | torch.Tensor | None = None, name: str | None = None,
             process_set: ProcessSet = global_process_set) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """Send ``splits[i]`` rows of ``tensor`` to the i-th member and receive theirs; differentiable.

    Args:
        tensor: rows to scatter (dim 0).
        splits: rows per destination (default: equal parts; dim 0 must then divide evenly).
        name: optional name.
        process_set: the ranks taking part.

    Returns:
        ``(output, received_splits)``: the received rows in member order and how many came from each.
    """
    out, received = _Alltoall.apply(tensor, splits, name, process_set)
    return out, received


class _Reducescatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, name: str | None, op: int, ps: ProcessSet, pre: float,
                post: float) -> torch.Tensor:  # fmt: skip
        ctx.args = (op, ps, pre * post)
        return A.synchronize(A.reducescatter_async(tensor, name, op, ps, pre, post))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        op, ps, scale = ctx.args
        full = A.synchronize(A.allgather_async(grad.contiguous(), None, ps))
        if op == R.Average:
            scale = scale / ps.size()
        return (full * scale if scale != 1.0 else full), None, None, None, None, None


def reducescatter(
    tensor: torch.Tensor, name: str | None = None, compression: type[Compressor] = Compression.none,
    op: int = R.Average, process_set: ProcessSet = global_process_set, prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
) -> torch.Tensor:  # fmt: skip
    """Reduce across members and return this member's slice of dim 0; differentiable.

    Returns:
        Rows ``[start, start + d0 // size (+1 for the first d0 % size members))`` of the reduced tensor.
    """
    compressed, cctx = compression.compress(tensor)
    out = _Reducescatter.apply(compressed, name, op, process_set, prescale_factor, postscale_factor)
    return compression.decompress(out, cctx)


def grouped_reducescatter(
    tensors: Sequence[torch.Tensor], name: str | None = None, compression: type[Compressor] = Compression.none,
    op: int = R.Average, process_set: ProcessSet = global_process_set, prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
) -> list[torch.Tensor]:  # fmt: skip
    """Reduce-scatter each tensor; returns the list of slices."""
    packed = [compression.compress(t) for t in tensors]
    handle = A.grouped_reducescatter_async([p[0] for p in packed], name, op, process_set, prescale_factor,
                                           postscale_factor)  # fmt: skip
    return [compression.decompress(o, p[1]) for o, p in zip(A.synchronize(handle), packed)]
