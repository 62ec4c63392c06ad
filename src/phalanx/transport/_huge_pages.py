"""Transparent huge pages for the memory peers read with cross-memory attach (Linux).

``process_vm_readv`` pins every remote page it copies from, so it copies from ordinary 4 KiB pages at about
half the rate it reaches from memory backed by 2 MiB transparent huge pages, which is close to a local copy
(docs/shm.md). Gradients reduced in place (read by the peer twice per step: once to be reduced, once
reduced; ``_many``) live in the glibc heap, in 4 KiB pages, so those reads are a large part of a step.
(Other large allreduces on one host stream through the slots, ``_stream``, and read no peer memory.)

:func:`advise` gives the 2 MiB blocks a tensor covers ``MADV_HUGEPAGE`` and ``MADV_COLLAPSE`` (Linux 6.1+:
the kernel moves the block into a huge page now, a copy of at most 2 MiB, instead of waiting for khugepaged).
Both are transparent: the memory keeps its contents and addresses, and anything else in those blocks (the
heap's other allocations) is unaffected but for its page size. A block is advised the ``SIGHTINGS``-th time a
tensor covers it, and never again (remembered by address): gradients freed by ``zero_grad(set_to_none=True)``
and re-allocated by autograd keep landing in a bounded set of heap blocks (``_malloc.tune`` keeps the heap
mapped), most of them every step, some only once; a collapse costs milliseconds per block, so a block
covered once is not worth it; and a 2-rank job's grad blocks churn more, so at most ``MAX_BLOCKS`` (64 MiB)
are advised per process: a bounded one-time cost, spent on the first blocks covered twice. Failures (no
THP in the kernel, ``never`` in ``/sys/kernel/mm/transparent_hugepage/enabled``, a kernel before 6.1, a
block not entirely mapped) are ignored: the reads then simply stay at the 4 KiB rate.
``PHALANX_SHM_THP=0`` turns it off.
"""

from __future__ import annotations

import ctypes
import sys
from collections.abc import Iterable
from dataclasses import dataclass, field

from phalanx.env import settings

BLOCK = 2 << 20  # a transparent huge page on x86-64 (and arm64 with 4 KiB base pages)
MIN_BYTES = 2 * BLOCK  # smaller tensors are skipped: at most one whole block in them, and the partial blocks
# they cover are shared with allocations that move (the CNN's 3.2 MB gradient visited 16-19 blocks in 40 steps)
MAX_BLOCKS = 32  # blocks advised per process (64 MiB): bounds the one-time cost (see the module)
MAX_SIGHTED = 1 << 14  # blocks remembered before their second sighting
SIGHTINGS = 2  # a block is advised the second time a tensor covers it (see the module)
MADV_HUGEPAGE = 14
MADV_COLLAPSE = 25


def enabled() -> bool:
    """Whether ``PHALANX_SHM_THP`` allows advising (unset or anything but ``0``/``false``/``no``/``off``)."""
    return settings.SHM_THP.get()


def _madvise() -> object | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes, fn.restype = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int], ctypes.c_int
    return fn


@dataclass
class Advisor:
    """The blocks this process advised, and what the kernel answered (``collapsed``: blocks now in huge pages
    by ``MADV_COLLAPSE``; ``refused``: blocks it did not collapse)."""

    seen: set[int] = field(default_factory=set)  # blocks advised
    sighted: dict[int, int] = field(default_factory=dict)  # blocks not yet advised -> times covered
    collapsed: int = 0
    refused: int = 0
    calls: int = 0
    errors: dict[int, int] = field(default_factory=dict)  # errno -> runs refused with it

    def advise(self, ranges: Iterable[tuple[int, int]]) -> None:
        """Advise the blocks that the (address, bytes) ranges cover, once each (see the module)."""
        if not enabled():
            return
        fn = _MADVISE
        if fn is None:
            return
        for start, count in _runs(self._new_blocks(ranges)):
            self.calls += 1
            fn(start * BLOCK, count * BLOCK, MADV_HUGEPAGE)  # type: ignore[operator]
            if fn(start * BLOCK, count * BLOCK, MADV_COLLAPSE) == 0:  # type: ignore[operator]
                self.collapsed += count
            else:
                self.refused += count
                err = ctypes.get_errno()
                self.errors[err] = self.errors.get(err, 0) + 1

    def _new_blocks(self, ranges: Iterable[tuple[int, int]]) -> list[int]:
        """The blocks the ranges cover for the ``SIGHTINGS``-th time (each block is returned once, ever)."""
        new: list[int] = []
        for addr, nbytes in ranges:
            if nbytes < MIN_BYTES or len(self.seen) >= MAX_BLOCKS or len(self.sighted) >= MAX_SIGHTED:
                continue
            for block in range(addr // BLOCK, (addr + nbytes - 1) // BLOCK + 1):
                if block in self.seen:
                    continue
                count = self.sighted.get(block, 0) + 1
                if count < SIGHTINGS:
                    self.sighted[block] = count
                    continue
                self.sighted.pop(block, None)
                if len(self.seen) < MAX_BLOCKS:
                    self.seen.add(block)
                    new.append(block)
        return new


def _runs(blocks: list[int]) -> list[tuple[int, int]]:
    """Consecutive blocks as (first block, count) runs, ascending."""
    out: list[tuple[int, int]] = []
    for b in sorted(blocks):
        if out and out[-1][0] + out[-1][1] == b:
            out[-1] = (out[-1][0], out[-1][1] + 1)
        else:
            out.append((b, 1))
    return out


_MADVISE = _madvise()
ADVISOR = Advisor()


def advise(ranges: Iterable[tuple[int, int]]) -> None:
    """:meth:`Advisor.advise` on this process's advisor."""
    ADVISOR.advise(ranges)
