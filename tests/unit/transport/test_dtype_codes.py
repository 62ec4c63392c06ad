"""Every torch dtype has a code of its own in both mismatch checks (issue 32, item 2); the whole dtype x dtype
matrix through real ranks is tests/multiprocess/torch/test_dtype_matrix.py."""

from __future__ import annotations

import itertools

import torch

# white-box: the wire format's dtype codes and checks: internal (no public name)
from phalanx.torch._engine import header
from phalanx.transport import _check
from phalanx.transport.api import dtype_code, dtype_name, dtype_of

DTYPES = sorted({d for d in vars(torch).values() if isinstance(d, torch.dtype)}, key=str)


def test_every_dtype_has_a_distinct_non_zero_code_that_reads_back() -> None:
    codes = [dtype_code(d) for d in DTYPES]
    assert len(set(codes)) == len(DTYPES) and 0 not in codes
    assert all(dtype_of(c) is d for c, d in zip(codes, DTYPES, strict=True))
    assert dtype_name(dtype_code(torch.float8_e5m2)) == "float8_e5m2"
    assert dtype_of(0x1234) is None and dtype_name(0x1234) == "dtype #00001234"  # a dtype torch here lacks


def test_the_shm_check_tells_every_pair_of_dtypes_apart() -> None:
    sigs = {d: _check.signature("broadcast", d, 4, root=0) for d in DTYPES}
    assert len(set(sigs.values())) == len(DTYPES)
    assert "uint16[4]" in _check.describe(sigs[torch.uint16])


def _sig(dtype: torch.dtype) -> header.Signature:
    return header.Signature(kind="broadcast", name="t", dtype=dtype, device=0, shape=(4,), root=0)


def _decoded(dtype: torch.dtype) -> header.Signature:
    return header.decode(header.encode(_sig(dtype), [], None, 0, 0)[: header.HEADER_WORDS].tolist())


def test_the_engine_header_round_trips_every_dtype_and_finds_every_pair() -> None:
    assert all(_decoded(d).dtype is d for d in DTYPES)
    for a, b in itertools.permutations(DTYPES, 2):
        detail = header.find_mismatch([_decoded(a), _decoded(b)], [0, 1])
        assert detail is not None and detail.startswith("dtype:"), (a, b, detail)


def test_a_dtype_unknown_here_decodes_to_its_code_and_still_mismatches() -> None:
    words = header.encode(_sig(torch.float32), [], None, 0, 0)[: header.HEADER_WORDS].tolist()
    words[header.F_DTYPE] = 0x1234
    theirs = header.decode(words)
    assert theirs.dtype == "dtype #00001234"
    assert header.find_mismatch([_decoded(torch.float32), theirs], [0, 1]) is not None
