"""The in-place multi-tensor allreduce's address arithmetic (``transport/_many.py``,
``_cross_memory.readv``), in one process."""

from __future__ import annotations

import ctypes
import os

import pytest
import torch

# white-box: the cross-memory copies and their pieces, internal (no public name)
from phalanx.transport import _cross_memory, _many


def _segments(tensors: list[torch.Tensor]) -> list[tuple[int, int]]:
    return [(t.data_ptr(), t.numel() * t.element_size()) for t in tensors]


def test_pieces_cover_a_virtual_range_across_segments() -> None:
    segs = [(1000, 8), (2000, 4), (3000, 12)]  # virtual bytes [0, 8) [8, 12) [12, 24)
    assert _many.pieces(segs, 0, 24) == [(0, 0, 8, 0), (1, 0, 4, 8), (2, 0, 12, 12)]
    assert _many.pieces(segs, 6, 14) == [(0, 6, 2, 6), (1, 0, 4, 8), (2, 0, 2, 12)]
    assert _many.pieces(segs, 12, 24) == [(2, 0, 12, 12)]
    assert _many.pieces(segs, 5, 5) == []


@pytest.mark.parametrize(("start", "stop"), [(0, 400), (36, 244), (200, 204), (396, 400)])
def test_pairs_move_the_same_virtual_bytes_between_different_segmentations(start: int, stop: int) -> None:
    src = torch.arange(100, dtype=torch.float32)  # 400 bytes, segmented two ways
    remote = [src[:7].clone(), src[7:50].clone(), src[50:].clone()]
    dst = [torch.zeros(33), torch.zeros(1), torch.zeros(66)]
    for local_addr, remote_addr, n in _many.pairs(_segments(dst), _segments(remote), start, stop):
        ctypes.memmove(local_addr, remote_addr, n)
    got = torch.cat(dst)
    lo, hi = start // 4, stop // 4
    assert torch.equal(got[lo:hi], src[lo:hi])
    assert not got[:lo].any() and not got[hi:].any()  # nothing outside the range was written


def test_partial_copies_resume_inside_a_pair() -> None:
    pairs = [(10, 110, 4), (20, 120, 8), (40, 140, 2)]
    assert _cross_memory._advance(list(pairs), 0) == pairs
    assert _cross_memory._advance(list(pairs), 4) == pairs[1:]
    assert _cross_memory._advance(list(pairs), 7) == [(23, 123, 5), (40, 140, 2)]
    assert _cross_memory._advance(list(pairs), 14) == []


def test_readv_scatters_and_gathers_within_this_process() -> None:
    probe = torch.tensor([os.getpid()], dtype=torch.int64)
    if not _cross_memory.probe(os.getpid(), probe.data_ptr(), os.getpid().to_bytes(8, "little", signed=True)):
        pytest.skip("process_vm_readv is not permitted here")
    src = [torch.arange(10, dtype=torch.float64), torch.arange(10, 30, dtype=torch.float64)]
    dst = [torch.zeros(25, dtype=torch.float64), torch.zeros(5, dtype=torch.float64)]
    _cross_memory.readv(os.getpid(), _many.pairs(_segments(dst), _segments(src), 0, 240))
    assert torch.equal(torch.cat(dst), torch.arange(30, dtype=torch.float64))
    with pytest.raises(OSError):
        _cross_memory.readv(os.getpid(), [(dst[0].data_ptr(), 8, 8)])  # address 8: not mapped
