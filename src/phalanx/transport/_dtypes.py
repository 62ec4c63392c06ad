"""A code for every torch dtype, the same in every process: what the collective-mismatch checks compare.

The code is the CRC-32 of the dtype's name (``torch.float8_e5m2``), so every dtype has its own, a dtype
torch adds later included, without a table to keep up to date (a fixed list gave every unlisted dtype one
shared code, and ranks disagreeing on uint16 vs uint64 passed the check). 0 stands for "no dtype";
``tests/unit/transport/test_dtype_codes.py`` checks that torch's dtypes have distinct, non-zero codes.
"""

from __future__ import annotations

import functools
import zlib

import torch


def dtype_code(dtype: torch.dtype) -> int:
    """``dtype``'s code: a non-zero unsigned 32-bit integer, distinct per dtype name."""
    return zlib.crc32(str(dtype).encode()) or 1


@functools.cache
def _known() -> dict[int, torch.dtype]:
    return {dtype_code(d): d for d in vars(torch).values() if isinstance(d, torch.dtype)}


def dtype_of(code: int) -> torch.dtype | None:
    """The dtype of a code, or None for a dtype this process's torch does not have."""
    return _known().get(code)


def dtype_name(code: int) -> str:
    """A code as a person reads it: ``float8_e5m2``, or ``dtype #1a2b3c4d`` for one torch here lacks."""
    dtype = dtype_of(code)
    return f"dtype #{code:08x}" if dtype is None else str(dtype).removeprefix("torch.")
