"""The control area's waits: a peer that arrived and then exited is not a failure; one that died first is."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from types import SimpleNamespace

import pytest

from phalanx.errors import ShmTransportError

# white-box: the control block, below the public transport API (no public name)
from phalanx.transport import _control
from phalanx.transport._control import CHECK_S, Control, layout


def _dead_pid() -> int:
    """The pid of a process that has exited and been reaped."""
    proc = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True, check=True)
    return int(proc.stdout)


class _Clock:
    """A clock for ``_control``: each nap jumps past the dead-peer check interval; the ``at``-th nap (from 0)
    runs ``action``, as a peer would act while this rank sleeps."""

    def __init__(self, action: Callable[[], None] | None = None, at: int = 0) -> None:
        self.t, self.naps, self.action, self.at = 0.0, 0, action, at

    def monotonic(self) -> float:
        return self.t

    def sleep(self, _s: float) -> None:
        self.t += 2 * CHECK_S
        if self.naps == self.at and self.action is not None:
            self.action()
        self.naps += 1


def _control_of_two(peer_pid: int) -> Control:
    _ctl, total = layout(2, 0)
    ctl = Control(SimpleNamespace(buf=bytearray(total)), 0, 2, 0, 30.0, "ranks [0, 1]", ranks=(0, 1))
    ctl.words[ctl._pid(1)] = peer_pid
    return ctl


def test_a_peer_that_arrives_and_exits_during_the_nap_is_not_a_failure(monkeypatch: pytest.MonkeyPatch) -> None:
    """The clock read before the nap is stale after it: the peer's arrival must be read before its death."""
    ctl = _control_of_two(_dead_pid())
    k = ctl._arrive(1)

    def arrive() -> None:
        ctl.words[k] = 1  # the peer's last step: it arrives, reads, and exits (its pid is already dead)

    # The first nap ends before the first check is due; the second is followed by a check on the time read
    # before it, after the peer arrived and left.
    monkeypatch.setattr(_control, "time", _Clock(arrive, at=1))
    ctl._wait_slow(k, 1, 1, "allgather")
    assert ctl.broken is None and ctl.words[0] == 0


def test_a_peer_that_died_before_arriving_fails_the_wait_naming_it(monkeypatch: pytest.MonkeyPatch) -> None:
    pid = _dead_pid()
    ctl = _control_of_two(pid)
    monkeypatch.setattr(_control, "time", _Clock())
    with pytest.raises(ShmTransportError, match=rf"peer rank 1 \(pid {pid}\) has died or exited"):
        ctl._wait_slow(ctl._arrive(1), 1, 1, "allgather")
    assert ctl.words[0] == 1  # the failure is signalled to the channel's other ranks
