"""Collectives over one :class:`~phalanx.transport._channel.Channel`, chunked to the slot size.

Each function works on flat contiguous CPU tensors and finishes before it returns (the work objects
phalanx hands out for them are already complete).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from phalanx.errors import InvalidArgumentError
from phalanx.transport import _cross_memory, _stream
from phalanx.transport._channel import Channel

_Combine = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], object]


_COMBINERS: dict[tuple[object, bool], _Combine] = {}


def _kind(op: object) -> object:
    """The ``ReduceOp.RedOpType`` of ``op``: process groups receive ``AllreduceOptions.reduceOp`` as a
    ``ReduceOp`` object, which compares equal to its type but does not hash-match it in a dict."""
    return getattr(op, "op", op) if isinstance(op, dist.ReduceOp) else op


def _combiner(op: object, dtype: torch.dtype) -> _Combine:
    """``f(a, b, out)`` for a torch.distributed reduce op; bool follows gloo (sum/max = or, product/min = and)."""
    op = _kind(op)
    key = (op, dtype == torch.bool)
    try:
        return _COMBINERS[key]
    except KeyError:
        pass
    except TypeError:  # an unhashable op object
        return _make_combiner(op, dtype)
    fn = _COMBINERS[key] = _make_combiner(op, dtype)
    return fn


def _make_combiner(op: object, dtype: torch.dtype) -> _Combine:
    R = dist.ReduceOp
    if dtype == torch.bool:
        if op in (R.SUM, R.MAX, R.BOR):
            return lambda a, b, out: torch.logical_or(a, b, out=out)
        if op in (R.PRODUCT, R.MIN, R.BAND):
            return lambda a, b, out: torch.logical_and(a, b, out=out)
        if op == R.BXOR:
            return lambda a, b, out: torch.logical_xor(a, b, out=out)
    table: dict[object, _Combine] = {
        R.SUM: lambda a, b, out: torch.add(a, b, out=out),
        R.PRODUCT: lambda a, b, out: torch.mul(a, b, out=out),
        R.MIN: lambda a, b, out: torch.minimum(a, b, out=out),
        R.MAX: lambda a, b, out: torch.maximum(a, b, out=out),
        R.BAND: lambda a, b, out: torch.bitwise_and(a, b, out=out),
        R.BOR: lambda a, b, out: torch.bitwise_or(a, b, out=out),
        R.BXOR: lambda a, b, out: torch.bitwise_xor(a, b, out=out),
    }
    if op not in table:
        raise InvalidArgumentError(f"reduce op {op} is not supported by the shared-memory transport (nor by gloo)")
    return table[op]


def supports(op: object, dtype: torch.dtype) -> bool:
    """Whether :func:`allreduce_` can reduce ``dtype`` with ``op`` (a ``RedOpType`` or ``ReduceOp``)."""
    op = _kind(op)
    if op == dist.ReduceOp.AVG:  # a sum, then a division (FSDP2's reduce-scatter asks for it)
        return dtype.is_floating_point or dtype.is_complex
    if dtype.is_complex and op != dist.ReduceOp.SUM:
        return False
    if op in (dist.ReduceOp.BAND, dist.ReduceOp.BOR, dist.ReduceOp.BXOR) and dtype.is_floating_point:
        return False  # gloo refuses it too (every rank alike, rather than some mid-way)
    try:
        _combiner(op, dtype)
    except (ValueError, TypeError):
        return False
    return True


def _parts(numel: int, n: int) -> list[tuple[int, int]]:
    base, extra = divmod(numel, n)
    bounds, start = [], 0
    for i in range(n):
        stop = start + base + (1 if i < extra else 0)
        bounds.append((start, stop))
        start = stop
    return bounds


SMALL_BYTES = 64 * 1024  # up to this size every rank reduces everything: one barrier instead of two
# With two ranks, up to this size: each rank adds the whole tensor (not half of it) but the step needs one
# rendezvous instead of three (cross-memory: addresses, reduced halves, done), each of which may wait for a
# descheduled peer on a busy host; below this size the saved rendezvous outweigh the extra additions, for
# the transport alone and inside Keras training (BENCHMARKS.md).
SMALL_BYTES_TWO_RANKS = 512 * 1024


def small_limit(ch: Channel) -> int:
    """Up to how many bytes :func:`allreduce_` exchanges whole tensors through the slots (common knowledge)."""
    return min(SMALL_BYTES_TWO_RANKS if ch.n == 2 else SMALL_BYTES, ch.slot_bytes)


def _allreduce_small(ch: Channel, t: torch.Tensor, raw: torch.Tensor, combine: _Combine) -> None:
    def read(views: list[torch.Tensor]) -> None:
        combine(views[0], views[1], t)
        for v in views[2:]:
            combine(t, v, t)

    ch.exchange(raw, read, "allreduce", t.dtype)


def allreduce_(ch: Channel, t: torch.Tensor, op: object) -> None:
    """Reduce ``t`` (flat, contiguous, CPU) across the channel, in place.

    Up to :func:`small_limit` every rank reduces whole tensors exchanged through the slots (one barrier);
    above it rank ``i`` reduces part ``i`` (like gloo's ring: 1/n of the arithmetic per rank), streamed
    through the slots chunk by chunk (``_stream``). Each element is reduced by one rank only, so results
    agree bitwise.
    """
    if ch.n == 1:
        return
    if _kind(op) == dist.ReduceOp.AVG:
        allreduce_(ch, t, dist.ReduceOp.SUM)
        t.div_(ch.n)
        return
    combine = _combiner(op, t.dtype)
    size = t.element_size()
    raw = t.view(torch.uint8) if t.numel() else t
    if t.numel() * size <= small_limit(ch):
        _allreduce_small(ch, t, raw, combine)
        return
    if _stream.fits(ch):
        _stream.allreduce_(ch, t, combine, _parts(t.numel(), ch.n))
        return
    _allreduce_segment(ch, t, raw, combine)


def _allreduce_segment(ch: Channel, t: torch.Tensor, raw: torch.Tensor, combine: _Combine) -> None:
    """The two-phase step per slot-sized chunk (large allreduces when the slots are too small to stream)."""
    step = max(1, ch.slot_bytes // t.element_size())
    size = t.element_size()
    for start in range(0, t.numel(), step):
        out = t[start : start + step]
        parts = _parts(out.numel(), ch.n)

        def first(slots: list[torch.Tensor], out: torch.Tensor = out, parts: list[tuple[int, int]] = parts) -> None:
            a, b = parts[ch.me]
            views = [s.view(out.dtype)[a:b] for s in slots]
            mine = views[ch.me]
            if ch.n == 2:
                combine(views[0], views[1], mine)
                return
            acc = out[a:b]
            combine(views[0], views[1], acc)
            for v in views[2:]:
                combine(acc, v, acc)
            mine.copy_(acc)

        def second(slots: list[torch.Tensor], out: torch.Tensor = out, parts: list[tuple[int, int]] = parts) -> None:
            for i, (a, b) in enumerate(parts):
                out[a:b].copy_(slots[i].view(out.dtype)[a:b])

        ch.exchange2(raw[start * size : (start + out.numel()) * size], first, second, "allreduce")


CMA_CHUNK = 1 << 20  # bytes read from a peer per cross-memory copy before reducing them (stays in L2)


def uses_cma(ch: Channel, t: torch.Tensor) -> bool:
    """Whether :func:`allreduce_cma_` applies to ``t`` (cross-memory attach agreed, above ``SMALL_BYTES``; on
    two ranks :func:`allreduce_` itself still exchanges whole tensors up to ``SMALL_BYTES_TWO_RANKS``)."""
    return ch.cma and ch.n > 1 and t.numel() * t.element_size() > min(SMALL_BYTES, ch.slot_bytes)


def allreduce_cma_(ch: Channel, t: torch.Tensor, op: object, between: Callable[[torch.Tensor], None],
                   each: Callable[[torch.Tensor], None] | None = None) -> None:
    """:func:`allreduce_`'s cross-memory path (when :func:`uses_cma`), calling ``between`` with this rank's
    part once it is reduced and before the peers read it: a reduce-scatter, ``between``, an allgather
    (the hierarchical allreduce across hosts, ``_hier``, allreduces each part among the hosts there).
    ``each``, when given, is called with every piece of the part as soon as that piece is reduced, in order
    (the pieces cover the part), so that the crossing of a piece overlaps the reduction of the next."""
    _allreduce_cma(ch, t, _combiner(op, t.dtype), between, each)


def _allreduce_cma(ch: Channel, t: torch.Tensor, combine: _Combine,
                   between: Callable[[torch.Tensor], None] | None = None,
                   each: Callable[[torch.Tensor], None] | None = None) -> None:
    """Allreduce without the segment: rank ``i`` reads part ``i`` of every peer's tensor (cross-memory
    attach, chunk by chunk into a cached scratch buffer) and reduces it into its own tensor in rank order;
    after a barrier every rank reads every other part, reduced, straight from its owner's tensor."""
    size, parts, base = t.element_size(), _parts(t.numel(), ch.n), t.data_ptr()
    scratch = ch.scratch_buffers(CMA_CHUNK)
    step = max(1, CMA_CHUNK // size)

    def first(peers: list[tuple[int, int]]) -> None:
        a, b = parts[ch.me]
        for s in range(a, b, step):
            e = min(b, s + step)
            nb = (e - s) * size
            views = []
            for j, (pid, addr) in enumerate(peers):
                if j == ch.me:
                    views.append(t[s:e])
                    continue
                _cross_memory.read(pid, scratch[j].data_ptr(), addr + s * size, nb)
                views.append(scratch[j][:nb].view(t.dtype))
            _reduce_into(views, t[s:e], scratch[ch.me][:nb].view(t.dtype), combine)
            if each is not None:
                each(t[s:e])
        if between is not None:
            between(t[a:b])

    def second(peers: list[tuple[int, int]]) -> None:
        for j, (pid, addr) in enumerate(peers):
            a, b = parts[j]
            if j != ch.me and b > a:
                _cross_memory.read(pid, base + a * size, addr + a * size, (b - a) * size)

    ch.attach_step(base, first, second, "allreduce")


def _reduce_into(views: list[torch.Tensor], out: torch.Tensor, acc: torch.Tensor, combine: _Combine) -> None:
    """``out = views[0] op views[1] op ...`` in rank order (``out`` may be one of the views)."""
    if len(views) == 2:
        combine(views[0], views[1], out)
        return
    combine(views[0], views[1], acc)
    for v in views[2:]:
        combine(acc, v, acc)
    out.copy_(acc)


def allgather_(ch: Channel, out: torch.Tensor, inp: torch.Tensor) -> None:
    """Gather every rank's ``inp`` (flat uint8, equal sizes) into ``out`` (flat uint8) in rank order."""
    m = inp.numel()
    for start in range(0, m, ch.slot_bytes):
        stop = min(m, start + ch.slot_bytes)

        def read(slots: list[torch.Tensor], start: int = start, stop: int = stop) -> None:
            for i, s in enumerate(slots):
                out[i * m + start : i * m + stop].copy_(s)

        ch.exchange(inp[start:stop], read, "allgather")


def broadcast_(ch: Channel, t: torch.Tensor, root: int) -> None:
    """Copy the root's ``t`` (flat uint8) into every rank's ``t``; ``root`` is an index on the channel."""
    for start in range(0, t.numel(), ch.slot_bytes):
        part = t[start : start + ch.slot_bytes]
        ch.publish(root, part, part, "broadcast")
