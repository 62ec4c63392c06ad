"""Joined-rank flags: a ``DistributedOptimizer`` step needs no announcement block while no rank has joined.

``hvd.join()`` makes a rank serve the others' optimizer steps (``phalanx.torch._join``); to know a step is
coming, a joined rank waits for the control block the live ranks send in ``synchronize()``. That block
costs every step a control round (~0.1-0.2 ms on one host), although almost no step ever meets a joined
rank. On a single-host control channel of the global process set, words in the spare end of its control
page replace it in the common case:

* per rank: a *joined* flag (set by ``hvd.join()``, cleared when it returns);
* shared: the last *decision*, ``2 * step + silent``, and the layout index of that step's optimizer.

Every rank counts the optimizer steps it took part in (live, or serving as a joined rank): the same count
on every rank, since a step completes only when every rank has served it. The first live rank to reach
step ``s`` decides, under an ``fcntl`` lock (Python has no compare-and-swap on shared memory, and x86 may
reorder a store with a later load): *silent* when no flag is set, else *announced*; the other live ranks
follow the recorded decision, so all of them send the block or none does. A rank that joins sets its flag
under the same lock and reads the decision: a silent step it has not taken part in (``step = its count +
1``) was decided before the flag and is served at once, outside the control rounds; every later step sees
the flag and is announced. At most one step can be pending so (a step completes only when every rank
serves it, so no rank decides step ``s + 1`` before the joining rank has served ``s``).
"""

from __future__ import annotations

import fcntl
import weakref
from dataclasses import dataclass

from phalanx.torch.shm._channel import LINE, Channel, control_lines, layout

_LOCK_BYTE = 1  # byte of the first rank's wake-up FIFO locked (``_early`` locks byte 0)
_FLAGS: weakref.WeakKeyDictionary[Channel, Flags] = weakref.WeakKeyDictionary()


@dataclass
class Flags:
    """One control channel's joined flags and step decisions (see the module).

    Attributes:
        ch: the global process set's control channel; base: the first word of the flags.
        lock_fd: the first rank's wake-up FIFO (every rank has it open), locked around the decisions.
        steps: optimizer steps this rank took part in on the set (live or joined).
    """

    ch: Channel
    base: int
    lock_fd: int
    steps: int = 0

    def _decision(self) -> int:
        return self.base + self.ch.n

    def decide(self, layout_id: int) -> bool:
        """A live rank's next optimizer step: True when it is silent (no announcement block, on every rank)."""
        self.steps += 1
        w, s, d = self.ch.words, self.steps, self._decision()
        fcntl.lockf(self.lock_fd, fcntl.LOCK_EX, 1, _LOCK_BYTE)  # held for a few word accesses only
        try:
            last = w[d]
            if last >> 1 == s:  # another live rank decided this step first
                return bool(last & 1)
            silent = not any(w[self.base + j] for j in range(self.ch.n))
            w[d + 1] = layout_id
            w[d] = 2 * s + int(silent)
            return silent
        finally:
            fcntl.lockf(self.lock_fd, fcntl.LOCK_UN, 1, _LOCK_BYTE)

    def join(self) -> int | None:
        """Set this rank's flag; the layout index of a silent step it must serve now, or None."""
        w, d = self.ch.words, self._decision()
        fcntl.lockf(self.lock_fd, fcntl.LOCK_EX, 1, _LOCK_BYTE)
        try:
            w[self.base + self.ch.me] = 1
            last, layout_id = w[d], w[d + 1]
        finally:
            fcntl.lockf(self.lock_fd, fcntl.LOCK_UN, 1, _LOCK_BYTE)
        if last & 1 and last >> 1 == self.steps + 1:
            self.steps += 1
            return int(layout_id)
        return None

    def leave(self) -> None:
        """Clear this rank's flag (``hvd.join()`` returned, or failed)."""
        self.ch.words[self.base + self.ch.me] = 0

    def served(self) -> None:
        """Count an announced step this joined rank served."""
        self.steps += 1


def flags(ch: Channel | None) -> Flags | None:
    """The flags of the global process set's control channel ``ch`` (None when it has none: no channel, one
    rank, no wake-up FIFOs to lock, or no room in its control page; then every step is announced)."""
    if ch is None or ch.n < 2 or ch.wake_r < 0 or len(ch.wake_w) != ch.n:
        return None
    found = _FLAGS.get(ch)
    if found is not None:
        return found
    base = control_lines(ch.n) * LINE // 8
    if base + ch.n + 2 > layout(ch.n, ch.slot_bytes)[0] // 8:
        return None
    found = Flags(ch, base, ch.wake_r if ch.me == 0 else ch.wake_w[0])
    _FLAGS[ch] = found
    return found
