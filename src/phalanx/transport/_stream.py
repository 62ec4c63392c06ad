"""Large allreduces streamed through the slots: a pipeline of chunks, no barrier, no cross-memory attach.

Rank ``i`` reduces part ``i`` of the tensor (``parts``, as every path). Each rank's slot holds two rings of
``RING`` entries of ``chunk_bytes`` blocks: a *raw* entry (this rank's chunk of every other rank's part,
``n - 1`` blocks) and a *reduced* entry (one block: a chunk of this rank's part, reduced). Chunk ``c`` of
part ``j`` is ``step`` elements from ``parts[j][0] + c * step``. On rank ``i``, for chunk ``c``:

1. *feed*: once every peer has read raw entry ``c - RING`` (its ``RAW_IN`` counter), copy chunk ``c`` of every
   other part from the tensor into raw entry ``c % RING``; publish ``RAW_OUT = c + 1``;
2. *reduce*: once every peer fed chunk ``c`` (``RAW_OUT``) and has read reduced entry ``c - RING``
   (``RED_IN``), reduce chunk ``c`` of part ``i`` (the peers' raw blocks and the own tensor, in rank order)
   into reduced entry ``c % RING``; ``RAW_IN = c + 1``; copy it into the tensor; ``RED_OUT = c + 1``;
3. *collect* chunk ``c - 1`` (one chunk behind, so that the peers have usually reduced it already): once
   every peer's ``RED_OUT`` passed it, copy it from their reduced entries into the tensor; ``RED_IN = c``.

The counters (``Channel.count``) run on across steps from a base every rank agrees on (the chunks of
earlier streamed steps); a counter is written after the data it counts, and a writer reuses an entry only
after every reader counted it read, so no read is torn. Peers never touch the caller's tensor: the call
returns as soon as this rank has collected every part (``done``; the next step's start waits for every
peer's ``done`` before a slot is reused). Each element is reduced by one rank and copied bit for bit by the
others. Per rank the data moves once from the tensor into a ring and once back, and the rings (2 MiB per
rank at the default slot size) stay in the caches: about half the memory traffic of the cross-memory step,
and no page pinning by the kernel. With ``RING = 2`` no wait can close a cycle: each one waits for a step
the peer takes before it needs anything from this rank's current chunk.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from phalanx.transport._channel import Channel

RING = 2  # entries per ring: deeper or larger rings leave the L2 cache
RAW_OUT, RAW_IN, RED_OUT, RED_IN = range(4)  # the chunk counters (``Channel.count`` kinds)
WHAT = "allreduce"

_Combine = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], object]


def chunk_bytes(ch: Channel) -> int:
    """Bytes of one ring block: the slot split into ``RING`` entries of ``n`` blocks, 64-byte aligned (0: the
    slot is too small to stream through)."""
    return ch.slot_bytes // (RING * ch.n) // 64 * 64


def fits(ch: Channel) -> bool:
    """Whether the channel's slots can hold the rings (a block of at least 64 bytes: any dtype's element)."""
    return ch.n > 1 and chunk_bytes(ch) > 0


@dataclass
class _Rings:
    raw: list[list[list[torch.Tensor]]]  # [rank][entry][block]: the blocks of the other parts, in rank order
    red: list[list[torch.Tensor]]  # [rank][entry]


def _rings(ch: Channel, dtype: torch.dtype, step: int) -> _Rings:
    """Every rank's ring entries as ``dtype`` views of ``step`` elements (cached on the channel)."""
    key = (dtype, step)
    rings = ch.rings.get(key)
    if isinstance(rings, _Rings):
        return rings
    cb, nb, n = chunk_bytes(ch), step * torch.empty((), dtype=dtype).element_size(), ch.n

    def block(i: int, k: int) -> torch.Tensor:
        return ch.slots[i][k * cb : k * cb + nb].view(dtype)

    raw = [[[block(i, e * (n - 1) + q) for q in range(n - 1)] for e in range(RING)] for i in range(n)]
    red = [[block(i, RING * (n - 1) + e) for e in range(RING)] for i in range(n)]
    if len(ch.rings) >= 16:
        ch.rings.clear()
    rings = ch.rings[key] = _Rings(raw, red)
    return rings


def allreduce_(ch: Channel, t: torch.Tensor, combine: _Combine, parts: list[tuple[int, int]]) -> None:
    """Reduce ``t`` (flat, contiguous, CPU, ``parts[i]`` reduced by rank ``i``) in place (see the module)."""
    step = chunk_bytes(ch) // t.element_size()
    chunks = max(-(-(b - a) // step) for a, b in parts)
    run = _Run(ch, t, combine, parts, step, _rings(ch, t.dtype, step), ch.stream_begin())
    for c in range(chunks):
        run.feed(c)
        run.reduce(c)
        if c:
            run.collect(c - 1)
    if chunks:
        run.collect(chunks - 1)
    ch.stream_end(chunks)


@dataclass
class _Run:
    """One streamed allreduce on one rank (the three per-chunk steps of the module's protocol)."""

    ch: Channel
    t: torch.Tensor
    combine: _Combine
    parts: list[tuple[int, int]]
    step: int
    rings: _Rings
    base: int  # the counters' value before this step

    def _chunk(self, j: int, c: int) -> tuple[int, int]:
        a, b = self.parts[j]
        start = min(b, a + c * self.step)
        return start, min(b, start + self.step)

    def feed(self, c: int) -> None:
        ch = self.ch
        if c >= RING:
            ch.wait_counts(RAW_IN, self.base + c - RING + 1, WHAT)
        blocks = iter(self.rings.raw[ch.me][c % RING])
        for j in range(ch.n):
            if j != ch.me:
                start, stop = self._chunk(j, c)
                next(blocks)[: stop - start].copy_(self.t[start:stop])
        ch.post_count(RAW_OUT, self.base + c + 1)

    def reduce(self, c: int) -> None:
        ch, me, e = self.ch, self.ch.me, c % RING
        ch.wait_counts(RAW_OUT, self.base + c + 1, WHAT)
        if c >= RING:
            ch.wait_counts(RED_IN, self.base + c - RING + 1, WHAT)
        start, stop = self._chunk(me, c)
        mine = self.t[start:stop]
        raw = self.rings.raw
        views = [mine if j == me else raw[j][e][me if me < j else me - 1][: stop - start] for j in range(ch.n)]
        out = self.rings.red[me][e][: stop - start]
        self.combine(views[0], views[1], out)
        for v in views[2:]:
            self.combine(out, v, out)
        ch.post_count(RAW_IN, self.base + c + 1)
        mine.copy_(out)
        ch.post_count(RED_OUT, self.base + c + 1)

    def collect(self, c: int) -> None:
        ch = self.ch
        ch.wait_counts(RED_OUT, self.base + c + 1, WHAT)
        for j in range(ch.n):
            if j != ch.me:
                start, stop = self._chunk(j, c)
                self.t[start:stop].copy_(self.rings.red[j][c % RING][: stop - start])
        ch.post_count(RED_IN, self.base + c + 1)
