"""``shm._joined``: the per-step decision between a silent and an announced optimizer step (no processes)."""

from __future__ import annotations

import tempfile
from types import SimpleNamespace
from typing import Any

from phalanx.torch.shm._joined import Flags


def _ranks(n: int) -> tuple[list[Flags], Any]:
    """``n`` ranks' flags over one set of words (as the control page is shared), locking one temporary file."""
    words = memoryview(bytearray(8 * (n + 2))).cast("q")
    lock = tempfile.TemporaryFile()
    return [Flags(SimpleNamespace(words=words, n=n, me=i), 0, lock.fileno()) for i in range(n)], lock  # type: ignore[arg-type]


def test_steps_are_silent_until_a_rank_joins_and_every_live_rank_follows_the_first() -> None:
    (a, b, c), lock = _ranks(3)
    with lock:
        assert [a.decide(0), b.decide(0), c.decide(0)] == [True, True, True]
        assert b.join() is None  # step 1 was taken by b: nothing to serve
        assert a.decide(0) is False  # step 2: b's flag is up, announced
        b.served()
        assert c.decide(0) is False  # c follows a's record even though it decides after
        b.leave()
        assert [c.decide(1), a.decide(1)] == [True, True]  # step 3: nobody joined any more
        assert a.steps == b.steps + 1 == c.steps  # b did not serve step 3 (it had left: not joined)


def test_a_rank_that_joins_after_a_silent_step_was_decided_serves_it() -> None:
    (a, b), lock = _ranks(2)
    with lock:
        assert a.decide(0) and b.decide(0)
        assert a.decide(5) is True  # step 2 decided silent; b has not reached it
        assert b.join() == 5  # b must serve optimizer 5's step 2 now
        assert b.steps == a.steps == 2
        assert a.decide(5) is False  # step 3 sees b's flag
        assert b.join() is None  # a second look: nothing more to serve
