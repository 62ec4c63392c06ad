"""Speculative payloads: hide the signature check's round trip behind the payload of repeated allreduces.

The signature check costs one extra round trip before the payload can be sent, because sending
mismatched byte counts makes gloo abort the process. But training loops repeat the same collectives. Every
rank of a process set records the *agreed* signature of each collective (common knowledge: it comes from
the gathered control blocks, processed in issue order). When that history is periodic, every rank predicts
the next collective identically and, together with its control block, issues an allreduce of exactly the
predicted size and dtype:

* a rank whose collective matches the prediction contributes its data;
* a rank whose collective does not contributes zeros of the predicted shape (sizes still match: no abort).

When the gathered signatures all equal the prediction, the speculative allreduce *is* the payload: one
round trip. Otherwise its result is discarded and the collective proceeds as usual (mismatch error, inline,
or a normal payload), so a wrong guess costs bandwidth, never correctness. Every decision uses only common
knowledge, so all ranks take the same path.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any

import torch

from phalanx.torch._engine import header
from phalanx.torch._engine import reduce as reduction
from phalanx.transport import api as shm

HISTORY = 16
MAX_PERIOD = 8
CONFIRM = 8  # entries a period must explain before anything is predicted

Key = tuple[Any, ...]


def key_of(sig: header.Signature) -> Key:
    """What must match for a speculative allreduce to stand for the real one."""
    return (sig.kind, sig.dtype, sig.device, sig.shape, sig.op, sig.prescale, sig.postscale, sig.count,
            sig.group_hash, sig.process_set_id)


def _nbytes(key: Key) -> int:
    n = 1
    for d in key[3]:
        n *= d
    return n * torch.empty(0, dtype=key[1]).element_size()


@dataclass
class Predictor:
    """The agreed history of one membership's collectives and the period-based guess of the next."""

    history: deque[Key | None] = field(default_factory=lambda: deque(maxlen=HISTORY))
    since_worth: int = HISTORY  # entries recorded since the last one worth speculating on

    def record(self, key: Key | None) -> None:
        """Append an agreed signature (None: the ranks disagreed)."""
        self.history.append(key)
        self.since_worth = 0 if _worth(key) else self.since_worth + 1

    def predict(self) -> Key | None:
        """The next collective's key when the recent history is periodic, if it is an allreduce worth
        speculating on (a single CPU tensor beyond the inline size).

        The smallest period ``p <= MAX_PERIOD`` that explains the last ``max(2p, CONFIRM)`` entries wins, so
        an A A B B pattern is read as period 4, not as "A again" after two As.
        """
        if self.since_worth >= MAX_PERIOD or len(self.history) < CONFIRM:
            return None  # the guess is one of the last MAX_PERIOD entries: none is worth speculating on
        hist = list(self.history)
        for p in range(1, MAX_PERIOD + 1):
            window = max(2 * p, CONFIRM)
            if len(hist) < window:
                break
            recent = hist[-window:]
            if all(recent[i] == recent[i - p] for i in range(p, window)):
                guess = hist[-p]
                return guess if _worth(guess) else None
        return None


_WORTH: dict[Key, bool] = {}


def _worth(key: Key | None) -> bool:
    if key is None:
        return False
    worth = _WORTH.get(key)
    if worth is None:
        if len(_WORTH) >= 512:
            _WORTH.clear()
        worth = _WORTH[key] = _worth_uncached(key)
    return worth


def _worth_uncached(key: Key) -> bool:
    if key[0] != "allreduce" or key[7] != 1 or key[8] != 0 or key[2] != 0:
        return False
    return reduction.wire_dtype(key[1]) == key[1] and _nbytes(key) > header.INLINE_BYTES


_POOL: dict[tuple[int, torch.dtype], list[torch.Tensor]] = {}
_BUSY: set[int] = set()


def acquire(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """A reusable flat scratch buffer (fresh large allocations cost page faults on every call)."""
    for t in _POOL.setdefault((numel, dtype), []):
        if id(t) not in _BUSY:
            _BUSY.add(id(t))
            return t
    t = torch.empty(numel, dtype=dtype)
    _POOL[(numel, dtype)].append(t)
    _BUSY.add(id(t))
    return t


def release(t: torch.Tensor) -> None:
    """Return a buffer from :func:`acquire` to the pool."""
    _BUSY.discard(id(t))


def garbage(key: Key) -> torch.Tensor:
    """The zeros a non-matching rank contributes (the predicted shape and dtype), from the pool."""
    n = 1
    for d in key[3]:
        n *= d
    return acquire(n, key[1]).zero_()


def launch(buffer: torch.Tensor, key: Key, group: Any) -> Any:
    """Start the speculative allreduce of ``buffer`` with the predicted op."""

    return shm.all_reduce(buffer, op=reduction.dist_op(key[4], key[1]), group=group, async_op=True)
