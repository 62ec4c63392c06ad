"""A shared-memory channel's control area: its layout, the ranks' counters, waiting for a peer's counter, and
failing or aborting so that every rank of the channel fails alike.

``_channel.Channel`` builds its steps on this (the layout and the wait protocol are described there).
"""

from __future__ import annotations

import os
import select
import time
from collections.abc import Callable, Sequence

from phalanx.errors import PEER_DIED, ShmTransportError
from phalanx.transport._segment import Segment

LINE = 64
PAGE = 4096
SPIN = 400  # pure spins before yielding: a peer one step behind usually arrives within them
YIELD_S = 0.0  # sched_yield phase (off: under load a yield gives away a whole time slice), then block
CHECK_S = 0.05
# A blocked wait re-reads its counter at least this often even without a wake-up byte: with DDP's gloo
# group stepping in the same process, waits were observed to sit out whole select time-outs (cause not
# found yet; see BENCHMARKS.md), so the time-out bounds what a missed wake-up costs.
SELECT_S = 0.002
COUNTERS = 4  # chunk counters per rank for streamed steps (see ``_stream``)


class _Hooks:
    """The caller's wait callbacks (installed by ``api.set_wait_hooks``, see ``api.WaitHooks``; None: off).

    ``paused`` > 0 skips them: deferred grad-channel work and an early-reduction wait run inside a wait the
    caller did not start as one of its own collectives, so there is nothing for its callbacks to describe.
    """

    stalled: Callable[[float], Exception | None] | None = None
    resumed: Callable[[], None] | None = None
    verdict: Callable[[], Exception | None] | None = None  # a confirmed deadlock, raised instead of a failure
    pending: Callable[[], str | None] | None = None  # the caller's own operation this wait serves, for errors
    paused = 0


HOOKS = _Hooks()


def control_lines(n: int) -> int:
    """The 64-byte lines of the control area that the channel uses (the rest of its last page is spare:
    ``_early`` keeps its words there on the grad channel)."""
    return 4 * n + 1 + COUNTERS * n


def layout(n: int, slot_bytes: int) -> tuple[int, int]:
    """(bytes of the control area rounded to a page, total bytes) of a channel of ``n`` ranks."""
    ctl = -(-control_lines(n) * LINE // PAGE) * PAGE
    return ctl, ctl + n * slot_bytes


def _pid_dead(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            state = f.read().rsplit(b")", 1)[1].split()[0]
    except (OSError, IndexError):
        return True
    return state in (b"Z", b"X")


class Control:
    """The counters of ``n`` ranks at the start of a channel's region, and the waits on them.

    Args:
        seg: the mapped segment.
        base: the region's offset in the segment (page aligned).
        n: ranks on the channel; me: this rank's index among them.
        timeout_s: seconds one wait may take before ``ShmTransportError``.
        label: names the group in error messages.
        ranks: the ranks on the channel in index order, to name a peer in errors (empty: its index).
        knob: what raises ``timeout_s``, for the timeout's message.
    """

    def __init__(self, seg: Segment, base: int, n: int, me: int, timeout_s: float, label: str,
                 ranks: Sequence[int] = (), knob: str = "PHALANX_SHM_TIMEOUT_S") -> None:
        self.seg, self.n, self.me = seg, n, me
        self.timeout_s, self.label, self.knob = timeout_s, label, knob
        self.ranks = tuple(ranks)
        ctl, _total = layout(n, 0)
        self.words = memoryview(seg.buf)[base : base + ctl].cast("q")
        self.words[self._pid(me)] = os.getpid()
        self.broken: str | None = None
        self.inspected = True  # consult the wait hooks (False: waits run on a worker thread, see _serial)
        self.wake_r = -1  # this rank's wake-up FIFO (read end), and the peers' (write ends; -1 for self)
        self.wake_w: list[int] = []

    def set_wakeups(self, read_fd: int, write_fds: list[int]) -> None:
        """Use wake-up FIFOs (shared by the channels of one segment; the transport owns and closes them)."""
        self.wake_r, self.wake_w = read_fd, write_fds

    def _post(self, k: int, g: int) -> None:
        self.words[k] = g
        for fd in self.wake_w:
            if fd >= 0:
                try:
                    os.write(fd, b"\0")
                except (BlockingIOError, BrokenPipeError):
                    pass  # full, hence readable: the peer wakes anyway; or the peer has closed it (shut down)

    def _arrive(self, i: int) -> int:
        return (1 + i) * 8

    def _done(self, i: int) -> int:
        return (1 + self.n + i) * 8

    def _pid(self, i: int) -> int:
        return (1 + 2 * self.n + i) * 8

    def _addr(self, i: int) -> int:
        return (1 + 3 * self.n + i) * 8

    def peer_pids(self) -> list[int]:
        """The pids the ranks wrote (0 for one that has not attached yet)."""
        return [self.words[self._pid(i)] for i in range(self.n)]

    def _wait_all(self, index: Callable[[int], int], g: int, what: str) -> None:
        words = self.words
        for j in range(self.n):
            k = index(j)
            if words[k] >= g:
                continue
            spins = 0
            while words[k] < g and spins < SPIN:
                spins += 1
            if words[k] < g:
                self._wait_slow(k, g, j, what)

    def _wait_slow(self, k: int, g: int, j: int, what: str, step: int = -1) -> None:
        """Wait until word ``k`` (peer ``j``'s) reaches ``g``; errors name ``step`` (default: ``g``)."""
        words, step = self.words, g if step < 0 else step
        start = time.monotonic()
        next_check, nap = start + CHECK_S, 0.00002
        stalled = False
        while words[k] < g:
            now = time.monotonic()
            if now - start < YIELD_S:
                os.sched_yield()
            elif self.wake_r >= 0:
                self._block(words, k, g)
            else:
                time.sleep(nap)
                nap = min(nap * 2, CHECK_S / 10)
            if now >= next_check and words[k] < g:
                # ``now`` predates the nap: a peer may have arrived and exited during it, which is no failure.
                next_check = now + CHECK_S
                self._check(j, step, what, now - start, arrived=lambda: words[k] >= g)
                stalled = self._inspect(now - start, step, what) or stalled
        if stalled and HOOKS.resumed is not None:
            HOOKS.resumed()

    def _inspect(self, waited: float, g: int, what: str) -> bool:
        """Consult the wait hooks; True when they were consulted (raises their error, breaking the channel)."""
        hook = HOOKS.stalled
        if hook is None or HOOKS.paused or not self.inspected:
            return False
        error = hook(waited)
        if error is not None:
            self.broken = f"shared-memory {what} on {self.label} was abandoned at step {g}: {error}"
            raise error
        return True

    def _block(self, words: memoryview, k: int, g: int) -> None:
        if words[k] >= g:
            return
        ready, _w, _x = select.select([self.wake_r], [], [], SELECT_S)
        if ready:
            try:
                os.read(self.wake_r, 65536)
            except BlockingIOError:
                pass

    def _check(self, j: int, g: int, what: str, waited: float,
               arrived: Callable[[], bool] = lambda: False) -> None:
        """Fail the wait for peer ``j`` if a rank gave up, ``j`` died, or the timeout passed. ``arrived`` re-reads
        the awaited word after ``j`` is seen dead: a peer writes it before it exits, so a peer that arrived and
        then left (its last collective done) is read as arrived, not as dead."""
        culprit = self.words[0]
        if culprit:
            self._fail(f"{self._peer(culprit - 1)} gave up on it (its own error is the cause)", g, what, signal=False)
        pid, peer = self.words[self._pid(j)], self._peer(j)
        if pid and _pid_dead(pid) and not arrived():
            self._fail(
                f"{peer} (pid {pid}) {PEER_DIED} before reaching it (a rank that leaves while others still "
                "run collectives: give every rank the same number of steps, or call hvd.join() when done)", g, what,
            )
        if waited > self.timeout_s:
            self._fail(
                f"{peer} (pid {pid}) did not reach step {g} within {self.timeout_s:g} s: it is busy elsewhere or "
                f"issued other collectives (raise {self.knob} if ranks legitimately run apart that long)", g, what,
            )

    def _peer(self, j: int) -> str:
        return f"peer rank {self.ranks[j]}" if len(self.ranks) == self.n else f"peer index {j}"

    def _fail(self, cause: str, g: int, what: str, signal: bool = True) -> None:
        """Raise for a peer that died, gave up or never came: the error names the caller's pending operation
        (when the wait hooks tell it) and that peer. It never suggests turning shared memory off: the peer,
        not the transport, is the cause."""
        error = HOOKS.verdict() if HOOKS.verdict is not None and self.inspected else None
        if error is not None:
            self.broken = f"shared-memory {what} on {self.label} was abandoned at step {g}: {error}"
            raise error
        if signal and not self.words[0]:
            self.words[0] = 1 + self.me
        self.broken = f"shared-memory {what} on {self.label} failed at step {g}: {cause}"
        pending = HOOKS.pending() if HOOKS.pending is not None and self.inspected and not HOOKS.paused else None
        if pending:
            raise ShmTransportError(f"{pending} cannot complete: {cause} [shared-memory {what} on {self.label}, "
                                    f"step {g}]")
        raise ShmTransportError(
            f"{self.broken}. Every rank of the group must issue the same collectives in the same order"
        )

    def abort(self, cause: str) -> None:
        """Break the channel because this rank failed outside it (e.g. its leaders' gloo step): the peers
        waiting on it fail at their next check instead of waiting out the time-out."""
        if not self.words[0]:
            self.words[0] = 1 + self.me
        self.broken = f"shared-memory channel {self.label} was abandoned: {cause}"

    def _wait_one(self, j: int, g: int, what: str) -> None:
        k = self._arrive(j)
        spins = 0
        while self.words[k] < g and spins < SPIN:
            spins += 1
        if self.words[k] < g:
            self._wait_slow(k, g, j, what)
