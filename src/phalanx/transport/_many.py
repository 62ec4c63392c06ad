"""Allreduce of several tensors at once, straight from and into them: the ``DistributedOptimizer``'s gradients.

A bucket's gradients are separate tensors (autograd allocates each one). Fusing them into one buffer costs a
copy of every gradient per step, which on a CPU-bound rank is time taken from the computation. With
cross-memory attach (``_cross_memory``) the copy is not needed: each rank publishes a *table* of its buffer's segments
(address and bytes of each tensor, in the order of the virtual concatenation, plus the rank's scale), and the
steps of ``_ops._allreduce_cma`` run on the virtual buffer:

1. every rank publishes its table's address (``Channel.attach_step``) and reads its peers' tables;
2. rank ``i`` reads part ``i`` of every peer's virtual buffer (one ``process_vm_readv`` per peer and chunk,
   scattered over the peer's segments) and sums it into its own tensors, then applies the scale;
3. after a barrier, every rank reads every other part, reduced, straight from its owner's tensors into its own.

Ranks may segment the same virtual buffer differently (one rank fused its gradients into a buffer, another
did not; a joined rank contributes one zero buffer): the tables say where each byte is. Every allreduce of
the grad channel above the slot-exchange size speaks this protocol (``_dispatch``), so all of them meet.
"""

from __future__ import annotations

import ctypes
import struct

import torch
import torch.distributed as dist

from phalanx.errors import InvalidArgumentError
from phalanx.transport import _cross_memory
from phalanx.transport._channel import Channel
from phalanx.transport._ops import SMALL_BYTES, _Combine, _combiner, _kind, _parts, _reduce_into

TABLE_ENTRIES = 64  # segments a peer reads with the table's first read (more take a second read)
_HEAD = 2  # table words before the segments: the count, the scale (float64 bits)
CHUNK_BYTES = 1 << 20  # bytes read from a peer per copy before they are reduced (as _ops.CMA_CHUNK)

Segment = tuple[int, int]  # (address, bytes), in the order of the virtual buffer
Piece = tuple[int, int, int, int]  # (segment index, start byte in it, bytes, offset in the virtual buffer)


def eligible(ch: Channel, nbytes: int) -> bool:
    """Whether :func:`allreduce_` runs on ``ch`` for ``nbytes`` in all: cross-memory attach agreed, and above the
    size every rank exchanges whole through its slot. Common knowledge, so every rank decides alike."""
    return ch.n > 1 and ch.cma and nbytes > min(SMALL_BYTES, ch.slot_bytes)


def _table(segs: list[Segment], scale: float) -> ctypes.Array[ctypes.c_int64]:
    """This rank's table: segment count, scale (float64 bits), then (address, bytes) of each segment (padded to
    what a peer's first read covers). Plain ctypes words: a tensor's per-element writes are far slower."""
    words = [len(segs), struct.unpack("<q", struct.pack("<d", scale))[0], *(w for seg in segs for w in seg)]
    words += [0] * (_HEAD + 2 * TABLE_ENTRIES - len(words))
    return (ctypes.c_int64 * len(words))(*words)


def _peer_table(pid: int, addr: int) -> tuple[list[Segment], float]:
    """A peer's segments and scale, read from its table at ``addr``."""
    head = (ctypes.c_int64 * (_HEAD + 2 * TABLE_ENTRIES))()
    _cross_memory.read(pid, ctypes.addressof(head), addr, ctypes.sizeof(head))
    count = head[0]
    if count > TABLE_ENTRIES:
        head = (ctypes.c_int64 * (_HEAD + 2 * count))()
        _cross_memory.read(pid, ctypes.addressof(head), addr, ctypes.sizeof(head))
    words = head[_HEAD : _HEAD + 2 * count]
    return list(zip(words[0::2], words[1::2])), struct.unpack("<d", struct.pack("<q", head[1]))[0]


def pieces(segs: list[Segment], start: int, stop: int) -> list[Piece]:
    """The parts of the virtual byte range ``[start, stop)`` in each segment, in order."""
    out, base = [], 0
    for k, (_addr, nbytes) in enumerate(segs):
        lo, hi = max(start, base), min(stop, base + nbytes)
        if lo < hi:
            out.append((k, lo - base, hi - lo, lo))
        base += nbytes
        if base >= stop:
            break
    return out


def pairs(local: list[Segment], remote: list[Segment], start: int, stop: int) -> list[tuple[int, int, int]]:
    """(local address, remote address, bytes) copies that bring the remote virtual bytes ``[start, stop)`` into
    the same local virtual bytes (boundaries of both segmentations split the copies)."""
    mine, theirs = pieces(local, start, stop), pieces(remote, start, stop)
    out, i, j, li, rj = [], 0, 0, 0, 0
    while i < len(mine) and j < len(theirs):
        n = min(mine[i][2] - li, theirs[j][2] - rj)
        out.append((local[mine[i][0]][0] + mine[i][1] + li, remote[theirs[j][0]][0] + theirs[j][1] + rj, n))
        li, rj = li + n, rj + n
        if li == mine[i][2]:
            i, li = i + 1, 0
        if rj == theirs[j][2]:
            j, rj = j + 1, 0
    return out


def allreduce_(ch: Channel, tensors: list[torch.Tensor], op: object, scale: float = 1.0, start: int = 0) -> None:
    """Allreduce the concatenation of ``tensors`` (flat, contiguous, CPU, one dtype) in place (see the module).

    ``scale`` multiplies this rank's contribution (``op`` SUM only); each part's owner applies it after the sum:
    ``sum(x_j) * s`` when every rank's scale is ``s``, ``sum(x_j * s_j)`` otherwise. ``start``: only the
    virtual bytes from ``start`` on are reduced (the rest was, by ``_early``); each byte gets the same value as
    with ``start`` 0 (see :func:`lerp_owner`).

    Raises:
        ValueError: a scale with another op than SUM.
    """
    if scale != 1.0 and _kind(op) != dist.ReduceOp.SUM:
        raise InvalidArgumentError(f"a scaled allreduce must be a SUM, got {op}")
    size = tensors[0].element_size()
    mine = [(t.data_ptr(), t.numel() * size) for t in tensors]
    total = sum(n for _a, n in mine)
    parts = [(start + a * size, start + b * size) for a, b in _parts((total - start) // size, ch.n)]
    mid = lerp_owner(total, size, ch.n)
    table = _table(mine, scale)
    chunk = max(size, min(CHUNK_BYTES, max(b - a for a, b in parts)))
    seen: list[tuple[list[Segment], float]] = []

    def first(peers: list[tuple[int, int]]) -> None:
        seen.extend((mine, scale) if j == ch.me else _peer_table(pid, addr) for j, (pid, addr) in enumerate(peers))
        scratch = ch.scratch_buffers(chunk)
        a, b = parts[ch.me]
        for s, e in _chunks(a, b, chunk, mid):
            for j, (pid, _addr) in enumerate(peers):
                if j != ch.me:
                    segs = seen[j][0]
                    base = scratch[j].data_ptr() - s
                    _cross_memory.readv(pid, [(base + off, segs[k][0] + at, n) for k, at, n, off in pieces(segs, s, e)])
            owner = int(s >= mid)
            _reduce(tensors, pieces(mine, s, e), s, scratch, ch.me, op, [sc for _segs, sc in seen], owner)

    def second(peers: list[tuple[int, int]]) -> None:
        for j, (pid, _addr) in enumerate(peers):
            a, b = parts[j]
            if j != ch.me and b > a:
                _cross_memory.readv(pid, pairs(mine, seen[j][0], a, b))

    ch.attach_step(ctypes.addressof(table), first, second, "allreduce")


def lerp_owner(total: int, size: int, n: int) -> int:
    """The virtual byte where the second rank's part of a 2-rank allreduce of ``total`` bytes begins.

    The Average of two ranks is one ``lerp`` from the part owner's value towards the other's, which is not
    symmetric in the last bit; bytes before this one are computed as ``lerp(rank 0, rank 1)``, the others as
    ``lerp(rank 1, rank 0)``, whichever rank reduces them (a partial allreduce, or ``_early``), so that every
    byte gets the value of the plain allreduce."""
    return _parts(total // size, n)[0][1] * size if n == 2 else total


def _chunks(a: int, b: int, chunk: int, mid: int) -> list[tuple[int, int]]:
    """``[a, b)`` in ranges of at most ``chunk`` bytes, split at ``mid`` too."""
    out: list[tuple[int, int]] = []
    for lo, hi in ((a, min(b, mid)), (max(a, mid), b)):
        out.extend((s, min(hi, s + chunk)) for s in range(lo, hi, chunk))
    return out


def _reduce(tensors: list[torch.Tensor], own: list[Piece], s: int, scratch: list[torch.Tensor], me: int, op: object,
            scales: list[float], owner: int = -1) -> None:
    """Reduce this rank's pieces with the peers' copies of them (``scratch[j]`` holds virtual bytes from ``s``);
    ``owner``: the rank whose value a 2-rank Average starts from (see :func:`lerp_owner`; -1: this one)."""
    size, dtype = tensors[0].element_size(), tensors[0].dtype
    outs = [tensors[k][at // size : (at + n) // size] for k, at, n, _off in own]
    peers = [[scratch[j][off - s : off - s + n].view(dtype) for _k, _at, n, off in own] for j in range(len(scratch))]
    if _kind(op) == dist.ReduceOp.SUM and all(sc == scales[0] for sc in scales):
        if len(peers) == 2 and scales[0] == 0.5:  # Average of two ranks: one pass, (a + b) / 2 within an ulp
            if owner in (-1, me):
                torch._foreach_lerp_(outs, peers[1 - me], 0.5)
            else:
                for out, other in zip(outs, peers[1 - me]):
                    torch.lerp(other, out, 0.5, out=out)
            return
        for j, views in enumerate(peers):
            if j != me:
                torch._foreach_add_(outs, views)
        if scales[0] != 1.0:
            torch._foreach_mul_(outs, scales[0])
        return
    combine = _combiner(op, dtype)
    for i, out in enumerate(outs):
        views = [out if j == me else peers[j][i] for j in range(len(scratch))]
        _combine_scaled(views, out, scratch[me][: out.numel() * size].view(dtype), combine, scales)


def _combine_scaled(views: list[torch.Tensor], out: torch.Tensor, acc: torch.Tensor, combine: _Combine,
                    scales: list[float]) -> None:
    """``out = views[0] op views[1] op ...`` in rank order; with scales (SUM): ``sum(views[j] * scales[j])``."""
    if all(sc == 1.0 for sc in scales):
        _reduce_into(views, out, acc, combine)
        return
    total = views[0] * scales[0]
    for v, sc in zip(views[1:], scales[1:]):
        total.add_(v, alpha=sc)
    out.copy_(total)
