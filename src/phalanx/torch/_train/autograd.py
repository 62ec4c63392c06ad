"""Horovod's autograd Functions (``horovod.torch.mpi_ops.Horovod*``), with Horovod's signatures.

Backward passes (Horovod's definitions): allreduce -> allreduce of the gradient with the same arguments;
allgather -> averaged gradient, this member's rows; broadcast -> averaged gradient on the root, zero
elsewhere; alltoall -> alltoall of the gradient back with the received splits; reducescatter -> allgather
of the gradient, multiplied by the set size for ``Sum`` and by the pre- and postscale factors.
"""

from __future__ import annotations

from typing import Any

import torch

from phalanx.torch import async_ops
from phalanx.torch._engine import reduce as reduction
from phalanx.torch._setup import state as _state
from phalanx.torch.process_sets import ProcessSet


class HorovodAllreduce(torch.autograd.Function):
    """Allreduce of one tensor: ``apply(tensor, average, name, op, prescale, postscale, process_set)``."""

    @staticmethod
    @async_ops.runs_inline
    def forward(ctx: Any, tensor: torch.Tensor, average: bool | None, name: str | None, op: int | None,
                pre: float, post: float, ps: ProcessSet) -> torch.Tensor:
        ctx.args = (average, op, pre, post, ps)
        return async_ops.synchronize(async_ops.allreduce_async(tensor, average, name, op, pre, post, ps))

    @staticmethod
    @async_ops.runs_inline
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        average, op, pre, post, ps = ctx.args
        out = HorovodAllreduce.apply(grad.contiguous(), average, None, op, pre, post, ps)
        return out, None, None, None, None, None, None


class HorovodGroupedAllreduce(torch.autograd.Function):
    """``apply(average, name, op, prescale, postscale, process_set, *tensors)``; returns a tuple."""

    @staticmethod
    @async_ops.runs_inline
    def forward(ctx: Any, average: bool | None, name: str | None, op: int | None, pre: float, post: float,
                ps: ProcessSet, *tensors: torch.Tensor) -> Any:
        ctx.args = (average, op, pre, post, ps)
        handle = async_ops.grouped_allreduce_async(list(tensors), average, name, op, pre, post, ps)
        return tuple(async_ops.synchronize(handle))

    @staticmethod
    @async_ops.runs_inline
    def backward(ctx: Any, *grads: torch.Tensor) -> Any:
        average, op, pre, post, ps = ctx.args
        out = HorovodGroupedAllreduce.apply(average, None, op, pre, post, ps, *[g.contiguous() for g in grads])
        return (None, None, None, None, None, None, *out)


@async_ops.runs_inline
def _offset(ps: ProcessSet, dim: int) -> int:
    """Where this member's rows start in an allgather of first dimensions ``dim`` (one collective)."""
    dims = async_ops.synchronize(async_ops.allgather_async(torch.tensor([dim], dtype=torch.int64), None, ps))
    return int(dims[: ps.rank()].sum())


class HorovodAllgather(torch.autograd.Function):
    """``apply(tensor, name, process_set)``: concatenation along dim 0 in member order."""

    @staticmethod
    @async_ops.runs_inline
    def forward(ctx: Any, tensor: torch.Tensor, name: str | None, ps: ProcessSet) -> torch.Tensor:
        ctx.dim, ctx.ps = tensor.shape[0], ps
        return async_ops.synchronize(async_ops.allgather_async(tensor, name, ps))

    @staticmethod
    @async_ops.runs_inline
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        reduced = HorovodAllreduce.apply(grad.contiguous(), None, None, reduction.Average, 1.0, 1.0, ctx.ps)
        return reduced.narrow(0, _offset(ctx.ps, ctx.dim), ctx.dim), None, None


class HorovodGroupedAllgather(torch.autograd.Function):
    """``apply(name, process_set, *tensors)``; returns a tuple of concatenations."""

    @staticmethod
    @async_ops.runs_inline
    def forward(ctx: Any, name: str | None, ps: ProcessSet, *tensors: torch.Tensor) -> Any:
        ctx.dims, ctx.ps = [t.shape[0] for t in tensors], ps
        return tuple(async_ops.synchronize(async_ops.grouped_allgather_async(list(tensors), name, ps)))

    @staticmethod
    @async_ops.runs_inline
    def backward(ctx: Any, *grads: torch.Tensor) -> Any:
        reduced = HorovodGroupedAllreduce.apply(None, None, reduction.Average, 1.0, 1.0, ctx.ps,
                                                *[g.contiguous() for g in grads])
        dims = torch.tensor(ctx.dims, dtype=torch.int64).reshape(1, -1)
        every = async_ops.synchronize(async_ops.allgather_async(dims, None, ctx.ps))  # one row per member
        offsets = every[: ctx.ps.rank()].sum(0).tolist()
        return (None, None, *[r.narrow(0, int(o), d) for r, o, d in zip(reduced, offsets, ctx.dims)])


class HorovodBroadcast(torch.autograd.Function):
    """``apply(tensor, root_rank, name, process_set)``."""

    @staticmethod
    @async_ops.runs_inline
    def forward(ctx: Any, tensor: torch.Tensor, root: int, name: str | None, ps: ProcessSet) -> torch.Tensor:
        ctx.root, ctx.ps = root, ps
        return async_ops.synchronize(async_ops.broadcast_async(tensor, root, name, ps))

    @staticmethod
    @async_ops.runs_inline
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        reduced = HorovodAllreduce.apply(grad.contiguous(), None, None, reduction.Average, 1.0, 1.0, ctx.ps)
        if _state.topology().rank != ctx.root:
            reduced = reduced * 0
        return reduced, None, None, None


class HorovodAlltoall(torch.autograd.Function):
    """``apply(tensor, splits, name, process_set)``: the output alone without ``splits`` (Horovod),
    ``(output, received_splits)`` with them."""

    @staticmethod
    @async_ops.runs_inline
    def forward(ctx: Any, tensor: torch.Tensor, splits: Any, name: str | None, ps: ProcessSet) -> Any:
        out, received = async_ops.synchronize(async_ops.alltoall_async(tensor, splits, name, ps))
        ctx.received, ctx.ps = received, ps
        if splits is None:
            return out
        ctx.mark_non_differentiable(received)
        return out, received

    @staticmethod
    @async_ops.runs_inline
    def backward(ctx: Any, grad: torch.Tensor, *_unused: Any) -> Any:
        back, _ = async_ops.synchronize(async_ops.alltoall_async(grad.contiguous(), ctx.received, None, ctx.ps))
        return back, None, None, None


def _reducescatter_grad(grad: torch.Tensor, op: int, ps: ProcessSet, pre: float, post: float) -> torch.Tensor:
    scale = pre * post * (ps.size() if op == reduction.Sum else 1)
    return grad * scale if scale != 1.0 else grad


class HorovodReducescatter(torch.autograd.Function):
    """``apply(tensor, name, op, process_set, prescale, postscale)``."""

    @staticmethod
    @async_ops.runs_inline
    def forward(ctx: Any, tensor: torch.Tensor, name: str | None, op: int, ps: ProcessSet, pre: float,
                post: float) -> torch.Tensor:
        ctx.args = (op, ps, pre, post)
        return async_ops.synchronize(async_ops.reducescatter_async(tensor, name, op, ps, pre, post))

    @staticmethod
    @async_ops.runs_inline
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        op, ps, pre, post = ctx.args
        scaled = _reducescatter_grad(grad.contiguous(), op, ps, pre, post)
        return HorovodAllgather.apply(scaled, None, ps), None, None, None, None, None


class HorovodGroupedReducescatter(torch.autograd.Function):
    """``apply(name, op, process_set, prescale, postscale, *tensors)``; returns a tuple of slices."""

    @staticmethod
    @async_ops.runs_inline
    def forward(ctx: Any, name: str | None, op: int, ps: ProcessSet, pre: float, post: float,
                *tensors: torch.Tensor) -> Any:
        ctx.args = (op, ps, pre, post)
        handle = async_ops.grouped_reducescatter_async(list(tensors), name, op, ps, pre, post)
        return tuple(async_ops.synchronize(handle))

    @staticmethod
    @async_ops.runs_inline
    def backward(ctx: Any, *grads: torch.Tensor) -> Any:
        op, ps, pre, post = ctx.args
        scaled = [_reducescatter_grad(g.contiguous(), op, ps, pre, post) for g in grads]
        return (None, None, None, None, None, *HorovodGroupedAllgather.apply(None, ps, *scaled))
