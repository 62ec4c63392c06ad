"""Reduce-scatter on one host by cross-memory reads: rank ``i`` sums part ``i`` of every rank's input straight
into its output (``dist.reduce_scatter_tensor``, FSDP's gradient reduce-scatter).

Half an allreduce's traffic and no copy of the input: every rank publishes its input's address
(``Channel.attach_step``), reads part ``i`` of each peer's input chunk by chunk into a scratch buffer that
stays in cache, reduces it with its own part in rank order into its output, and returns once every peer has
finished reading its input (the caller may reuse it then). Each element is reduced by one rank only.
"""

from __future__ import annotations

import torch

from phalanx.transport import _cross_memory
from phalanx.transport._channel import Channel
from phalanx.transport._ops import CMA_CHUNK, SMALL_BYTES, _combiner, _reduce_into


def eligible(ch: Channel, nbytes: int) -> bool:
    """Whether :func:`reduce_scatter_` runs on ``ch`` for an input of ``nbytes`` (cross-memory attach agreed and
    above the size the slots exchange whole). Common knowledge, so every rank decides alike."""
    return ch.n > 1 and ch.cma and nbytes > min(SMALL_BYTES, ch.slot_bytes)


def reduce_scatter_(ch: Channel, out: torch.Tensor, inp: torch.Tensor, op: object,
                    parts: list[int] | None = None) -> None:
    """``out`` = part ``ch.me`` of the reduction of every rank's ``inp`` (flat, contiguous, CPU, one dtype;
    ``inp`` has ``ch.n`` times ``out``'s elements; ``op`` not ``AVG``: the caller divides a sum).

    ``parts``: instead, the element offsets in ``inp`` of the equal pieces whose reduction this rank writes
    into ``out``, one after the other (the ranks' pieces must not overlap; the hierarchical reduce-scatter
    across hosts gives each local rank one piece per host)."""
    combine = _combiner(op, inp.dtype)
    size, me = inp.element_size(), ch.me
    bases = parts if parts is not None else [me * out.numel()]
    n = out.numel() // len(bases)
    scratch = ch.scratch_buffers(CMA_CHUNK)
    step = max(1, CMA_CHUNK // size)

    def piece(peers: list[tuple[int, int]], base: int, dst: torch.Tensor) -> None:
        for s in range(0, n, step):
            e = min(n, s + step)
            nb = (e - s) * size
            views = []
            for j, (pid, addr) in enumerate(peers):
                if j == me:
                    views.append(inp[base + s : base + e])
                    continue
                _cross_memory.read(pid, scratch[j].data_ptr(), addr + (base + s) * size, nb)
                views.append(scratch[j][:nb].view(inp.dtype))
            _reduce_into(views, dst[s:e], scratch[me][:nb].view(inp.dtype), combine)

    def first(peers: list[tuple[int, int]]) -> None:
        for i, base in enumerate(bases):
            piece(peers, base, out[i * n : (i + 1) * n])

    ch.attach_step(inp.data_ptr(), first, lambda _peers: None, "reduce-scatter")
