"""Reduce operations: Horovod's op codes, their torch.distributed mapping and the local (inline) reduction."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from phalanx.errors import InvalidArgumentError

# Horovod's codes (horovod.common.basics): the values are part of the API.
Average = 0
Sum = 1
Adasum = 2
Min = 3
Max = 4
Product = 5

OP_NAMES = {Average: "Average", Sum: "Sum", Adasum: "Adasum", Min: "Min", Max: "Max", Product: "Product"}

_DIST_OP = {
    Average: dist.ReduceOp.SUM,
    Sum: dist.ReduceOp.SUM,
    Min: dist.ReduceOp.MIN,
    Max: dist.ReduceOp.MAX,
    Product: dist.ReduceOp.PRODUCT,
}

# Dtypes gloo cannot reduce natively travel as a wider dtype and are cast back.
_WIRE_DTYPE = {torch.int16: torch.int32, torch.bool: torch.uint8}


def check_op(op: int, dtype: torch.dtype) -> None:
    """Validate that ``op`` can reduce ``dtype``.

    Raises:
        NotImplementedError: ``Adasum`` (not implemented by phalanx).
        ValueError: an unknown op, ``Average`` of bool tensors, or Min/Max/Product of complex tensors.
    """
    if op == Adasum:
        raise NotImplementedError(
            "op=hvd.Adasum is not implemented by phalanx.torch; use op=hvd.Average or op=hvd.Sum"
        )
    if op not in OP_NAMES:
        raise InvalidArgumentError(
            f"unknown reduce op {op!r}; use hvd.Average, hvd.Sum, hvd.Min, hvd.Max or hvd.Product")
    if dtype == torch.bool and op == Average:
        raise InvalidArgumentError(
            "op=hvd.Average is not defined for bool tensors; use hvd.Sum (logical or) or hvd.Min")
    if dtype.is_complex and op not in (Average, Sum):
        raise InvalidArgumentError(
            f"op={OP_NAMES[op]} is not defined for complex tensors ({dtype}); use Sum or Average")


def resolve_op(op: int | None, average: bool | None) -> int:
    """Combine ``op`` with Horovod's deprecated ``average=`` flag.

    Raises:
        ValueError: both were given.
    """
    if average is not None:
        if op is not None:
            raise InvalidArgumentError("the average= argument is deprecated; pass only op=hvd.Average or op=hvd.Sum")
        return Average if average else Sum
    return Average if op is None else int(op)


def wire_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype a reduction of ``dtype`` is carried in over gloo."""
    return _WIRE_DTYPE.get(dtype, dtype)


def dist_op(op: int, dtype: torch.dtype) -> Any:
    """The torch.distributed op for a Horovod op on ``dtype`` (bool: Sum/Max = or, Min/Product = and)."""
    if dtype == torch.bool:
        return dist.ReduceOp.MAX if op in (Sum, Max) else dist.ReduceOp.MIN
    return _DIST_OP[op]


def reduce_stack(stack: torch.Tensor, op: int) -> torch.Tensor:
    """Reduce along dim 0 in rank order (the same arithmetic on every rank).

    Args:
        stack: ``[ranks, ...]`` tensor.
        op: a Horovod op code (Average is summed here; the caller divides).

    Returns:
        The reduced tensor, of ``stack``'s dtype.
    """
    dtype = stack.dtype
    if dtype == torch.bool:
        return stack.any(0) if op in (Sum, Max) else stack.all(0)
    if op in (Average, Sum):
        out = stack[0].clone()
        for row in stack[1:]:
            out += row
        return out
    if op == Min:
        return stack.amin(0)
    if op == Max:
        return stack.amax(0)
    return stack.prod(0).to(dtype)


def finish_scale(t: torch.Tensor, op: int, n: int, postscale: float) -> None:
    """Apply Average's division by ``n`` and the postscale factor in place (integers: the quotient rounded
    toward zero, as Horovod's integer scaling)."""
    divisor = n if op == Average else 1
    if t.dtype == torch.bool:
        return
    if t.is_floating_point() or t.is_complex():
        factor = postscale / divisor
        if factor != 1.0:
            t.mul_(factor)
        return
    if postscale != 1.0:
        t.copy_((t.double() * postscale).to(t.dtype))
    if divisor != 1:
        t.copy_(torch.div(t, divisor, rounding_mode="trunc"))


def prescale(t: torch.Tensor, factor: float) -> torch.Tensor:
    """Return ``t * factor`` (a new tensor), or ``t`` itself when the factor is 1."""
    if factor == 1.0 or t.dtype == torch.bool:
        return t
    if t.is_floating_point() or t.is_complex():
        return t * factor
    return (t.double() * factor).to(t.dtype)
