"""Keep large tensor allocations out of fresh ``mmap`` calls (glibc only), set up by ``hvd.init()``.

glibc serves an allocation above its mmap threshold (128 KiB at first, raised dynamically up to 32 MiB)
with a fresh ``mmap`` and gives it back with ``munmap`` on ``free``; it also returns the free top of the
heap to the kernel once it exceeds the trim threshold. Every such large tensor is then page-faulted in
again on first touch: on the development VM ``torch.empty(16M floats)`` followed by a copy took ~55 ms
instead of ~10 ms, which is what a new-tensor ``hvd.allreduce`` of 64 MB paid on every call.

``tune()`` raises both thresholds (``M_MMAP_THRESHOLD`` = ``MMAP_THRESHOLD_BYTES``, ``M_TRIM_THRESHOLD`` =
``TRIM_THRESHOLD_BYTES``) so that freed tensors up to that size stay in the heap and are reused without
faults. The trade-off: a rank keeps up to ``TRIM_THRESHOLD_BYTES`` of freed memory at the top of its heap
(plus whatever is freed below live blocks, as glibc always does) instead of returning it to the kernel, so
its resident size tracks its peak use rather than its current use. Allocations above the mmap threshold
keep glibc's behaviour. ``PHALANX_MALLOC_TUNE=0`` leaves glibc's defaults alone.
"""

from __future__ import annotations

import ctypes
import logging
import os
import platform
from collections.abc import Mapping

from phalanx.env import settings

LOG = logging.getLogger(__name__)

M_TRIM_THRESHOLD = -1  # glibc's <malloc.h> parameter numbers
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_BYTES = 256 * 1024 * 1024
TRIM_THRESHOLD_BYTES = 512 * 1024 * 1024
_FALLBACK_MMAP_THRESHOLD = 32 * 1024 * 1024  # the largest value glibc < 2.35 accepts on 64-bit

APPLIED: dict[str, int] = {}


def enabled(env: Mapping[str, str]) -> bool:
    """Whether ``PHALANX_MALLOC_TUNE`` allows tuning (unset or anything but ``0``/``false``/``no``/``off``)."""
    return settings.MALLOC_TUNE.get(env)


def tune(env: Mapping[str, str] | None = None) -> dict[str, int]:
    """Raise glibc's mmap and trim thresholds once per process (no-op off glibc or when disabled).

    Args:
        env: the environment to read; ``os.environ`` when None.

    Returns:
        The values applied (``{"mmap_threshold": ..., "trim_threshold": ...}``), empty when nothing was.
    """
    env = os.environ if env is None else env
    if APPLIED or not enabled(env) or platform.libc_ver()[0] != "glibc":
        return dict(APPLIED)
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return {}
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    mmap = MMAP_THRESHOLD_BYTES
    if not mallopt(M_MMAP_THRESHOLD, mmap):
        mmap = _FALLBACK_MMAP_THRESHOLD
        if not mallopt(M_MMAP_THRESHOLD, mmap):
            return {}
    if mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES):
        APPLIED.update(mmap_threshold=mmap, trim_threshold=TRIM_THRESHOLD_BYTES)
    LOG.debug("glibc malloc tuned: %s", APPLIED)
    return dict(APPLIED)
