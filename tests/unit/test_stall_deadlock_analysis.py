"""The stall inspector's deadlock analysis (phalanx/torch/_health/deadlock.py) on hand-made records, and its check
interval (_health/stall.py)."""

from __future__ import annotations

import pytest

# white-box: the stall and deadlock analyses, internal to phalanx.torch (no public name)
from phalanx.torch._health import deadlock as _deadlock
from phalanx.torch._health import stall as _stall


def _rec(rank: int, ranks: tuple[int, ...] | None, seq: int = 1, phase: str = "control",
         issued: dict[tuple[int, ...], int] | None = None, name: str = "x") -> _deadlock.Record:
    wait = None if ranks is None else {"ranks": ranks, "seq": seq, "phase": phase, "kind": "allreduce",
                                       "name": name, "psid": 1}
    return _deadlock.Record(rank, 1, wait, issued or {}, dict(issued or {}))


def test_ranks_waiting_on_each_other_in_different_sets_are_deadlocked() -> None:
    # rank 0 waits on [0, 1] (rank 1 never issued there); ranks 1 and 2 wait on the global set for rank 0.
    world = (0, 1, 2)
    records = {
        0: _rec(0, (0, 1), issued={(0, 1): 1, world: 0}),
        1: _rec(1, world, issued={(1, 2): 1, world: 1}),
        2: _rec(2, world, issued={(1, 2): 1, world: 1}),
    }
    assert _deadlock.deadlocked(records) == {0, 1, 2}
    text = _deadlock.describe({0, 1, 2}, records)
    assert "rank 0 waits in allreduce of tensor 'x' on process set 1 (ranks [0, 1]" in text
    assert "for rank 1 issued 0 there" in text and "for rank 0 issued 0 there" in text


def test_a_rank_waiting_for_a_running_rank_is_not_deadlocked() -> None:
    # rank 0 waits for rank 1, which waits on [1, 2] for rank 2, which is running (slow, no record).
    records = {0: _rec(0, (0, 1), issued={(0, 1): 1}), 1: _rec(1, (1, 2), issued={(1, 2): 1})}
    assert _deadlock.deadlocked(records) == set()


def test_a_peer_that_issued_the_collective_is_not_awaited() -> None:
    # both wait on [0, 1] #1 and both issued it: the transport is just slow.
    records = {0: _rec(0, (0, 1), issued={(0, 1): 1}), 1: _rec(1, (0, 1), issued={(0, 1): 1})}
    assert _deadlock.deadlocked(records) == set()


def test_a_payload_waits_for_peers_that_have_not_negotiated_it() -> None:
    # 0 waits for the payload of [0, 1] #1 (rank 1 issued its block but has not negotiated it: it is stuck
    # on [1, 2] waiting for rank 2, which waits on [0, 2] for rank 0): a cycle.
    records = {
        0: _rec(0, (0, 1), phase="payload", issued={(0, 1): 1, (0, 2): 0}),
        1: _rec(1, (1, 2), issued={(0, 1): 1, (1, 2): 1}),
        2: _rec(2, (0, 2), issued={(1, 2): 0, (0, 2): 1}),
    }
    records[1].rounds = {(0, 1): 0}
    assert _deadlock.deadlocked(records) == {0, 1, 2}
    records[1].rounds = {(0, 1): 1}  # rank 1 negotiated it: its payload is on its way, rank 0 will finish
    assert _deadlock.deadlocked(records) == set()


def test_records_round_trip_through_json() -> None:
    rec = _rec(3, (0, 3), seq=7, issued={(0, 3): 7, (0, 1, 2, 3): 2})
    back = _deadlock.Record.loads(rec.dumps())
    assert back == rec


def test_check_interval_reads_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PHALANX_STALL_CHECK_S", raising=False)
    assert _stall.check_interval() == _stall.DEFAULT_CHECK_S
    monkeypatch.setenv("PHALANX_STALL_CHECK_S", "0.5")
    assert _stall.check_interval() == 0.5
    monkeypatch.setenv("PHALANX_STALL_CHECK_S", "soon")
    with pytest.raises(ValueError, match="PHALANX_STALL_CHECK_S='soon'"):
        _stall.check_interval()
