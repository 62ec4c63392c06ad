"""Asynchronous and in-place collectives (Horovod's ``*_async``, ``*_`` names), ``poll`` and ``synchronize``.

Every function returns a handle at once; the collective runs on the background thread (``_background``)
and ``synchronize(handle)`` returns the result. Collectives match across ranks by name, unnamed ones by
their order of issue (``_names``, as Horovod); ranks that disagree about a collective get a
``CollectiveMismatchError`` (a ``RuntimeError``) from ``synchronize`` on every rank. A name is in flight
from the call until its collective has finished: a second one raises ``ValueError`` at the call.

Inside :func:`runs_inline` (the synchronous API: ``hvd.allreduce``, the autograd Functions, the helpers) the
same functions hand the collective to the engine on the caller's thread instead: no thread switch.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch

from phalanx.errors import InvalidArgumentError
from phalanx.torch._engine import background as _background
from phalanx.torch._engine import core as _engine
from phalanx.torch._engine import header
from phalanx.torch._engine import join as _join
from phalanx.torch._engine import reduce as reduction
from phalanx.torch._engine.collectives import Allgather, Allreduce, Alltoall, Barrier, Broadcast, Reducescatter
from phalanx.torch._runtime import RUNTIME
from phalanx.torch._setup import state as _state
from phalanx.torch.process_sets import ProcessSet, global_process_set, groups_of

_F = TypeVar("_F", bound=Callable[..., Any])


def runs_inline(fn: _F) -> _F:
    """Decorate a function that synchronizes the collectives it starts before returning: they run on the
    caller's thread (see the module)."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        mode = RUNTIME.mode
        if mode.inline:
            return fn(*args, **kwargs)
        mode.inline = True
        try:
            return fn(*args, **kwargs)
        finally:
            mode.inline = False

    return wrapper  # type: ignore[return-value]


def _start(coll: Any, ps: ProcessSet) -> int:
    """Hand ``coll`` to the engine now (inline mode), or queue it for the background thread."""
    if RUNTIME.mode.inline or _background.in_worker():
        return _engine.submit(coll, ps)
    groups_of(ps)  # a rank outside the set fails here, at the call, not in synchronize()
    return _background.start(lambda: _engine.run_job(coll, ps), coll.sig.name, _engine.busy)


def _sig(kind: str, name: str | None, tensor: torch.Tensor | None, ps: ProcessSet, **kw: Any) -> header.Signature:
    _state.topology()
    psid = ps.process_set_id if ps.process_set_id is not None else -1
    if tensor is None:
        return header.Signature(kind, name or "", torch.uint8, 0, (), process_set_id=psid, **kw)
    return header.Signature(kind, name or "", tensor.dtype, 1 if tensor.is_cuda else 0, tuple(tensor.shape),
                            process_set_id=psid, **kw)


def _members(ps: ProcessSet) -> tuple[int, int]:
    """(set size, this rank's index in the set)."""
    ranks = groups_of(ps).ranks
    return len(ranks), ranks.index(_state.topology().rank)


def _allreduce_handle(
    tensors: list[torch.Tensor], outputs: list[torch.Tensor], name: str | None, op: int, pre: float,
    post: float, ps: ProcessSet, grouped: bool,
) -> int:
    for t in tensors:
        reduction.check_op(op, t.dtype)
    devices = sorted({str(t.device) for t in tensors})
    if len(devices) > 1:
        raise InvalidArgumentError(
            f"grouped allreduce {name or '<unnamed>'!r}: its tensors are on different devices ({', '.join(devices)}); "
            "one collective runs on one device (NCCL for CUDA tensors, gloo for CPU ones): move them to one "
            "device, or reduce each device's tensors in a call of its own"
        )
    kw: dict[str, Any] = {"op": op, "prescale": pre, "postscale": post}
    if grouped:
        kw.update(group_hash=header.group_hash(tensors) or 1, count=len(tensors))
    sig = _sig("allreduce", name, tensors[0] if tensors else None, ps, **kw)
    n, _ = _members(ps)
    return _start(Allreduce(tensors, outputs, op, pre, post, n, sig), ps)


def allreduce_async(
    tensor: torch.Tensor, average: bool | None = None, name: str | None = None, op: int | None = None,
    prescale_factor: float = 1.0, postscale_factor: float = 1.0, process_set: ProcessSet = global_process_set,
) -> int:
    """Start an allreduce of ``tensor`` into a new tensor; return a handle for :func:`synchronize`.

    Args:
        tensor: the tensor to reduce (same shape and dtype on every rank of the set).
        average: deprecated; use ``op``. True means Average, False Sum.
        name: an optional name: ranks match collectives by it (unnamed ones by their order of issue); two
            in-flight ops of one rank may not share one.
        op: ``Average`` (default), ``Sum``, ``Min``, ``Max`` or ``Product``.
        prescale_factor: multiply the input by this before the reduction.
        postscale_factor: multiply the result by this after the reduction.
        process_set: the ranks taking part (default: all).

    Returns:
        A handle.

    Raises:
        ValueError: before ``hvd.init()``, bad op/dtype, or a name already in flight.
        NotImplementedError: ``op=Adasum``.
    """
    op_ = reduction.resolve_op(op, average)
    out = torch.empty_like(tensor)
    return _allreduce_handle([tensor], [out], name, op_, prescale_factor, postscale_factor, process_set, False)


def allreduce_async_(
    tensor: torch.Tensor, average: bool | None = None, name: str | None = None, op: int | None = None,
    prescale_factor: float = 1.0, postscale_factor: float = 1.0, process_set: ProcessSet = global_process_set,
) -> int:
    """In-place form of :func:`allreduce_async`: the result is written into ``tensor``."""
    op_ = reduction.resolve_op(op, average)
    return _allreduce_handle([tensor], [tensor], name, op_, prescale_factor, postscale_factor, process_set, False)


def grouped_allreduce_async(
    tensors: Sequence[torch.Tensor], average: bool | None = None, name: str | None = None,
    op: int | None = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
    process_set: ProcessSet = global_process_set,
) -> int:
    """Start one allreduce of several tensors (one signature check); ``synchronize`` returns a list."""
    op_ = reduction.resolve_op(op, average)
    outs = [torch.empty_like(t) for t in tensors]
    return _allreduce_handle(list(tensors), outs, name, op_, prescale_factor, postscale_factor, process_set, True)


def grouped_allreduce_async_(
    tensors: Sequence[torch.Tensor], average: bool | None = None, name: str | None = None,
    op: int | None = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
    process_set: ProcessSet = global_process_set,
) -> int:
    """In-place form of :func:`grouped_allreduce_async`."""
    op_ = reduction.resolve_op(op, average)
    ts = list(tensors)
    return _allreduce_handle(ts, ts, name, op_, prescale_factor, postscale_factor, process_set, True)


def allgather_async(tensor: torch.Tensor, name: str | None = None,
                    process_set: ProcessSet = global_process_set) -> int:
    """Start an allgather along dim 0 (the first dimension may differ per rank); return a handle."""
    if tensor.dim() == 0:
        raise InvalidArgumentError("allgather needs a tensor with at least one dimension; got a 0-d tensor")
    return _start(Allgather(tensor, _sig("allgather", name, tensor, process_set)), process_set)


def _group(handles: list[int]) -> int:
    grouped = RUNTIME.grouped
    gid = next(grouped.ids)
    grouped.members[gid] = handles
    return gid


def grouped_allgather_async(tensors: Sequence[torch.Tensor], name: str | None = None,
                            process_set: ProcessSet = global_process_set) -> int:
    """Start an allgather of each tensor; ``synchronize`` returns the list of results."""
    return _group([allgather_async(t, f"{name}.{i}" if name else None, process_set) for i, t in enumerate(tensors)])


def _broadcast(tensor: torch.Tensor, out: torch.Tensor, root_rank: int, name: str | None,
               ps: ProcessSet) -> int:
    ranks = groups_of(ps).ranks
    if root_rank not in ranks:
        raise InvalidArgumentError(f"root_rank={root_rank} is not a member of {ps!r} (ranks {list(ranks)})")
    sig = _sig("broadcast", name, tensor, ps, root=root_rank)
    return _start(Broadcast(tensor, out, root_rank, sig), ps)


def broadcast_async(tensor: torch.Tensor, root_rank: int, name: str | None = None,
                    process_set: ProcessSet = global_process_set) -> int:
    """Start a broadcast of ``root_rank``'s tensor (a global rank) into a new tensor; return a handle."""
    return _broadcast(tensor, torch.empty_like(tensor), root_rank, name, process_set)


def broadcast_async_(tensor: torch.Tensor, root_rank: int, name: str | None = None,
                     process_set: ProcessSet = global_process_set) -> int:
    """In-place form of :func:`broadcast_async`: ``tensor`` receives the root's values."""
    return _broadcast(tensor, tensor, root_rank, name, process_set)


def _splits(tensor: torch.Tensor, splits: Sequence[int] | torch.Tensor | None, n: int) -> list[int]:
    if tensor.dim() == 0:
        raise InvalidArgumentError("alltoall needs a tensor with at least one dimension; got a 0-d tensor")
    d0 = tensor.shape[0]
    if splits is None:
        if d0 % n:
            raise InvalidArgumentError(f"alltoall without splits needs dim 0 ({d0}) divisible by the set size ({n})")
        return [d0 // n] * n
    values = [int(s) for s in (splits.tolist() if isinstance(splits, torch.Tensor) else splits)]
    if len(values) != n or sum(values) != d0 or min(values) < 0:
        raise InvalidArgumentError(f"alltoall splits={values} must be {n} non-negative counts summing to dim 0 ({d0})")
    return values


def alltoall_async(tensor: torch.Tensor, splits: Sequence[int] | torch.Tensor | None = None,
                   name: str | None = None, process_set: ProcessSet = global_process_set) -> int:
    """Start an alltoall: rows ``splits[i]`` go to the i-th member; ``synchronize`` returns
    ``(output, received_splits)``."""
    n, index = _members(process_set)
    values = _splits(tensor, splits, n)
    sig = _sig("alltoall", name, tensor, process_set)
    return _start(Alltoall(tensor, values, index, sig), process_set)


def reducescatter_async(
    tensor: torch.Tensor, name: str | None = None, op: int = reduction.Average,
    process_set: ProcessSet = global_process_set, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
) -> int:
    """Start a reduce-scatter along dim 0 (the first ``d0 % size`` members get one extra row)."""
    reduction.check_op(op, tensor.dtype)
    if tensor.dim() == 0:
        raise InvalidArgumentError("reducescatter needs a tensor with at least one dimension; got a 0-d tensor")
    n, index = _members(process_set)
    sig = _sig("reducescatter", name, tensor, process_set, op=op, prescale=prescale_factor,
               postscale=postscale_factor)
    coll = Reducescatter(tensor, op, prescale_factor, postscale_factor, index, n, sig)
    return _start(coll, process_set)


def grouped_reducescatter_async(
    tensors: Sequence[torch.Tensor], name: str | None = None, op: int = reduction.Average,
    process_set: ProcessSet = global_process_set, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
) -> int:
    """Start a reduce-scatter of each tensor; ``synchronize`` returns the list of results."""
    handles = [
        reducescatter_async(t, f"{name}.{i}" if name else None, op, process_set, prescale_factor, postscale_factor)
        for i, t in enumerate(tensors)
    ]
    return _group(handles)


def poll(handle: int) -> bool:
    """Return True when the collective of ``handle`` has finished; never blocks.

    Raises:
        ValueError: the handle is unknown (or was already synchronized).
    """
    subs = RUNTIME.grouped.members.get(handle)
    if subs is not None:
        return all(poll(h) for h in subs)
    if _background.is_handle(handle):
        done, result = _background.poll(handle)
        if not isinstance(result, _engine.Parked):
            return done
        return _background.idle() and _engine.poll(result.handle)  # the engine is the thread's while busy
    return _engine.poll(handle)


def synchronize(handle: int) -> Any:
    """Wait for a collective and return its result (grouped handles: the list of results).

    Raises:
        CollectiveMismatchError: ranks disagreed about the collective (on every rank; a RuntimeError).
        ValueError: the handle is unknown.
    """
    subs = RUNTIME.grouped.members.pop(handle, None)
    if subs is not None:
        return [synchronize(h) for h in subs]
    if _background.is_handle(handle):
        result = _background.wait(handle)
        return _engine.synchronize(result.handle) if isinstance(result, _engine.Parked) else result
    return _engine.synchronize(handle)


def synchronize_shared(handle: int, blocked: Callable[[], bool]) -> Any:
    """:func:`synchronize` for a thread that is one of several issuing and awaiting collectives at once
    (TensorFlow's executor threads running a graph's independent collectives): the engine is then used by
    the background thread only. While the collective is parked (the peers have not issued its name yet) the
    caller queues one round at a time behind the other threads' collectives, so they keep reaching the
    engine and can complete it, whatever order each rank issued them in.

    Args:
        handle: from an ``*_async`` call made on this thread.
        blocked: whether this rank can issue nothing more (then a round in which every rank is blocked
            fails the pending collectives instead of waiting forever).
    """
    subs = RUNTIME.grouped.members.pop(handle, None)
    if subs is not None:
        return [synchronize_shared(h, blocked) for h in subs]
    if not _background.is_handle(handle):
        return _engine.synchronize(handle)
    result = _background.wait(handle)
    if not isinstance(result, _engine.Parked):
        return result
    parked, pause = result.handle, 0.0
    while not _background.wait(_background.start(lambda: _engine.step_parked(parked, blocked()), "", _engine.busy)):
        time.sleep(pause)  # no progress: the peers' threads are busy elsewhere; do not spin rounds
        pause = min(_MAX_PAUSE_S, pause * 2 or 0.0005)
    return _background.wait(_background.start(lambda: _engine.synchronize(parked), "", _engine.busy))


_MAX_PAUSE_S = 0.02


def barrier(process_set: ProcessSet = global_process_set) -> None:
    """Block until every member of the set reaches the barrier."""
    _engine.run(Barrier(_sig("barrier", None, None, process_set)), process_set)


def join(device: int = -1) -> int:
    """Wait until every rank has called ``join``; return the global rank that joined last.

    As in Horovod, a rank that has joined keeps taking part in the other ranks' single-tensor allreduces on
    the global process set (contributing zeros, so ``Average`` still divides by the full size) and in their
    ``DistributedOptimizer`` steps (zero gradients), so ranks may process different numbers of batches.
    Other collectives issued while a rank is joined raise ``CollectiveMismatchError`` on the live ranks.

    Args:
        device: accepted for compatibility (Horovod's GPU id); unused.

    Returns:
        The global rank that called ``join`` last.
    """
    del device
    ranks = groups_of(global_process_set).ranks
    _engine.flush()  # earlier collectives first: the round count below is then the same on every rank
    joined_at = _engine.rounds(ranks)
    while True:
        coll = _join.Join(_sig("join", None, None, global_process_set), joined_at)
        last = _engine.run(coll, global_process_set)
        if last is not None:
            return int(ranks[last])


def optimizer_step_async(layout: int, process_set: ProcessSet) -> int:
    """Send the control block a ``DistributedOptimizer`` sends before waiting for its buckets (lets joined
    ranks serve the step; see ``_join``); returns a handle for :func:`synchronize`. Its round trip overlaps
    the bucket waits: a joined rank needs only the block itself to start serving."""
    sig = _sig("optimizer step", None, None, process_set, root=layout)
    return _engine.submit(_join.OptimizerStep(sig), process_set)
