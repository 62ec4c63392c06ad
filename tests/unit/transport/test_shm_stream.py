"""The streamed allreduce (``transport/_stream.py``) between threads of one process, one channel per thread on a
shared segment: two and three ranks, chunk counts that wrap the rings many times, uneven parts, several ops
and dtypes, steps of other kinds in between, and the fallback for slots too small to stream."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import torch
import torch.distributed as dist

# white-box: the streaming reduction, below the public transport API (no public name)
from phalanx.transport import _ops, _segment, _stream
from phalanx.transport._channel import Channel
from phalanx.transport._control import layout

R = dist.ReduceOp


def _ranks(n: int, slot: int, fn: Callable[[Channel], Any]) -> list[Any]:
    """``fn(channel)`` on ``n`` threads, one channel (rank index) each, on one segment."""
    seg = _segment.create(layout(n, slot)[1])
    _segment.unlink(seg.name)
    chs = [Channel(seg, 0, n, i, slot, 30.0, "threads") for i in range(n)]
    with ThreadPoolExecutor(n) as pool:
        futures = [pool.submit(fn, ch) for ch in chs]
        results = [f.result(timeout=120) for f in futures]
    for ch in chs:
        ch.close()
    return results


def _value(i: int, dtype: torch.dtype, numel: int) -> torch.Tensor:
    vals = torch.randint(1, 3, (numel,), generator=torch.Generator().manual_seed(31 * i + numel))
    return (vals > 1) if dtype == torch.bool else vals.to(dtype)


def _expected(n: int, dtype: torch.dtype, numel: int, op: Any) -> torch.Tensor:
    stack = torch.stack([_value(i, dtype, numel).double() for i in range(n)])
    red = {R.SUM: stack.sum(0), R.MAX: stack.amax(0), R.PRODUCT: stack.prod(0)}[op]
    return red.bool() if dtype == torch.bool else red.to(dtype)


CASES = [(torch.float32, R.SUM), (torch.float64, R.PRODUCT), (torch.int16, R.MAX), (torch.bool, R.SUM),
         (torch.bfloat16, R.SUM)]


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("n", "slot"), [(2, 4096), (3, 4096), (2, 1 << 20), (2, 192)])
def test_streamed_allreduce_matches_and_agrees_bitwise(n: int, slot: int) -> None:
    """Slot 4096: blocks of 1 KiB (two ranks) / 640 B (three: parts and blocks misaligned); 1 MiB: one
    chunk per part for the mid sizes; 192 B: too small to stream, the two-phase segment path."""
    sizes = [4099, 70001, 300_000] if slot >= 4096 else [1001]  # the segment path: one step per 96 bytes

    def rank(ch: Channel) -> list[torch.Tensor]:
        out = []
        for dtype, op in CASES:
            for numel in sizes:
                t = _value(ch.me, dtype, numel)
                _ops.allreduce_(ch, t, op)
                out.append(t)
                ch.barrier()  # another kind of step between streamed ones
        return out

    results = _ranks(n, slot, rank)
    cases = [(dtype, op, numel) for dtype, op in CASES for numel in sizes]
    for k, (dtype, op, numel) in enumerate(cases):
        want = _expected(n, dtype, numel, op)
        assert torch.equal(results[0][k], want), (dtype, op, numel)
        for other in results[1:]:
            assert torch.equal(other[k].view(torch.uint8), results[0][k].view(torch.uint8))


def test_chunk_layout() -> None:
    seg = _segment.create(layout(3, 4096)[1])
    _segment.unlink(seg.name)
    ch = Channel(seg, 0, 3, 0, 4096, 5.0, "solo")
    assert _stream.chunk_bytes(ch) == 640 and _stream.fits(ch)
    ch.slot_bytes = 320
    assert _stream.chunk_bytes(ch) == 0 and not _stream.fits(ch)
    ch.close()
