"""Transparent huge pages for the memory peers read with cross-memory attach (Linux).

``process_vm_readv`` pins every remote page it copies from: from ordinary 4 KiB pages it copied 5.1-5.6 GB/s
on the development VM, from memory backed by 2 MiB transparent huge pages 9.3-11 GB/s, close to a local copy
(11-14 GB/s). The ``DistributedOptimizer``'s gradients (read by the peer twice per step: once to be reduced,
once reduced) and DDP's buckets live in the glibc heap, in 4 KiB pages: the 5.8M-parameter MLP's step spent
4.3 ms in cross-memory reads of its 23 MB of gradients.

:func:`advise` gives the 2 MiB blocks a tensor covers ``MADV_HUGEPAGE`` and ``MADV_COLLAPSE`` (Linux 6.1+:
the kernel moves the block into a huge page now, a copy of at most 2 MiB, instead of waiting for khugepaged).
Both are transparent: the memory keeps its contents and addresses, and anything else in those blocks (the
heap's other allocations) is unaffected but for its page size. Each block is advised once per process
(remembered by address: gradients freed by ``zero_grad(set_to_none=True)`` and re-allocated by autograd land
in the same heap blocks, which ``_malloc.tune`` keeps mapped, so after the first steps nothing is left to
do); failures (no THP in the kernel, ``never`` in ``/sys/kernel/mm/transparent_hugepage/enabled``, a kernel
before 6.1, a block not entirely mapped) are ignored: the reads then simply stay at the 4 KiB rate.
``PHALANX_SHM_THP=0`` turns it off.
"""

from __future__ import annotations

import ctypes
import os
import sys
from collections.abc import Iterable
from dataclasses import dataclass, field

from phalanx.env import names as N

BLOCK = 2 << 20  # a transparent huge page on x86-64 (and arm64 with 4 KiB base pages)
MIN_BYTES = BLOCK  # tensors smaller than a block are not worth a system call
MAX_BLOCKS = 1 << 16  # blocks remembered (128 GiB of memory); beyond, nothing more is advised
MADV_HUGEPAGE = 14
MADV_COLLAPSE = 25


def enabled() -> bool:
    """Whether ``PHALANX_SHM_THP`` allows advising (unset or anything but ``0``/``false``/``no``/``off``)."""
    return os.environ.get(N.PHALANX_SHM_THP, "1").strip().lower() not in ("0", "false", "no", "off")


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

    seen: set[int] = field(default_factory=set)
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
        new: list[int] = []
        for addr, nbytes in ranges:
            if nbytes < MIN_BYTES or len(self.seen) >= MAX_BLOCKS:
                continue
            for block in range(addr // BLOCK, (addr + nbytes - 1) // BLOCK + 1):
                if block not in self.seen:
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
