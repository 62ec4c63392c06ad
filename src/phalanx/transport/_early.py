"""Early reduction: the rank that finished backward first reduces the gradients already final on both ranks
while it waits for the other (``DistributedOptimizer``, 2 ranks on one host, cross-memory attach).

On a step, one rank is idle in ``synchronize()`` until the slower one finishes backward; in backward the last
layers' gradients are final first. The idle rank (the *early worker*) sums, piece by piece in the layout
order of the first bucket, the gradients that are final on the peer too, writes each result into its own
gradient and into the peer's (``process_vm_writev``), and stops as soon as the peer arrives or the next
piece is not final; the plain allreduce then reduces only the bytes after the ``k`` it reached.

Words in the spare end of the grad channel's control page (after ``Channel``'s lines):

* per rank (own line): the step it arrived at, a joined flag, the layout fingerprint, its scale;
* shared (one line): the early worker ``2 * step + rank``, the step it stopped at, and ``k``;
* per rank: a (step, address) pair per parameter of the first bucket (the *marks*): the gradient hook
  writes the address, then the step (x86-64 keeps stores in order, so a peer that sees the step sees the
  address). The rank keeps a reference to the marked tensor until the step's end, so the peer never
  writes into freed memory.

A step's number is the grad channel's next generation (``Channel.gen + 1``): every rank, joined or not,
runs the same steps on the channel, so it is common knowledge; a step that reduced everything early runs an
empty barrier so that the number still advances. Who works is decided under an ``fcntl`` lock on the first
rank's wake-up FIFO (Python has no compare-and-swap on shared memory, and x86 may reorder a store with a
later load): the first to arrive becomes the worker if it can; the second sees it and waits (with the
channel's time-out and dead-peer checks) for its ``k``. A joined rank answers as the second rank and serves
the bytes after ``k`` with zeros. The result of every byte is the one the plain allreduce gives
(``_many.lerp_owner``), bit-identical on both ranks.
"""

from __future__ import annotations

import fcntl
import struct
import time
import weakref
from dataclasses import dataclass, field

import torch

from phalanx.env import settings
from phalanx.transport import _cross_memory, _huge_pages
from phalanx.transport._channel import Channel
from phalanx.transport._control import HOOKS, LINE, SPIN, control_lines, layout
from phalanx.transport._many import _chunks, eligible, lerp_owner

PIECE_BYTES = 256 * 1024  # bytes reduced before the worker looks again whether the peer has arrived
WAIT_S = 0.02  # longest wait for the peer's next gradient while the peer has not arrived
NAP_S = 0.00005  # sleep between looks at the peer's marks, after SPIN spins
STATS = {"steps": 0, "bytes": 0}  # this process: steps it reduced early as the worker, and the bytes
_RANK, _SHARED, _MARKS = 0, 16, 24  # word offsets in the spare area: rank lines, shared line, marks
_AREAS: weakref.WeakKeyDictionary[Channel, Area] = weakref.WeakKeyDictionary()


def enabled() -> bool:
    """Whether early reduction is allowed (``PHALANX_SHM_EARLY_REDUCE``, default on)."""
    return settings.SHM_EARLY_REDUCE.get()


def _bits(x: float) -> int:
    return int(struct.unpack("<q", struct.pack("<d", x))[0])


@dataclass
class Area:
    """One grad channel's early-reduction words, owned by the last ``DistributedOptimizer`` that claimed it.

    Attributes:
        ch: the channel; key: the owner's (process set id, layout index) (see ``_join.register_layout``).
        sizes: bytes of each parameter of the first bucket that has a mark; total: the bucket's bytes.
    """

    ch: Channel
    key: tuple[int, int]
    sizes: list[int]
    total: int
    base: int
    lock_fd: int
    kept: list[torch.Tensor | None] = field(default_factory=list)
    worked: bool = False  # whether this rank was the early worker of the last agreed step

    def _w(self, j: int, k: int) -> int:
        return self.base + _RANK + 8 * j + k  # rank j's line: 0 arrived, 1 joined, 2 fingerprint, 3 scale

    def _s(self, k: int) -> int:
        return self.base + _SHARED + k  # 0 worker (2 * step + rank), 1 stopped step, 2 stopped bytes

    def _mark(self, j: int, i: int) -> int:
        return self.base + _MARKS + 2 * (j * len(self.sizes) + i)

    def active(self) -> bool:
        """Whether this area still belongs to its optimizer (no later optimizer claimed the channel)."""
        return _AREAS.get(self.ch) is self

    def step(self) -> int:
        """The number of the channel's next step (the one this bucket's allreduce would start)."""
        return self.ch.gen + 1

    def mark(self, i: int, grad: torch.Tensor, scale: float) -> None:
        """Publish that gradient ``i`` of the first bucket is final on this rank for the next step."""
        if i < len(self.sizes):
            w, me = self.ch.words, self.ch.me
            self.kept[i] = grad
            w[self._w(me, 3)] = _bits(scale)
            w[self._mark(me, i) + 1] = grad.data_ptr()
            w[self._mark(me, i)] = self.step()

    def release(self) -> None:
        """Forget the marked tensors (the step is over)."""
        self.kept = [None] * len(self.sizes)

    def _arrive(self, s: int, work: bool, joined: bool) -> str:
        """'early' (this rank works), 'wait' (the peer works: wait for its k) or 'plain' (nobody works)."""
        w, me = self.ch.words, self.ch.me
        fcntl.lockf(self.lock_fd, fcntl.LOCK_EX, 1, 0)  # held for a few word accesses only
        try:
            peer_in = w[self._w(1 - me, 0)] >= s
            w[self._w(me, 0)], w[self._w(me, 1)] = s, int(joined)
            if not peer_in and work:
                w[self._s(0)] = 2 * s + me
                return "early"
            return "wait" if w[self._s(0)] == 2 * s + 1 - me else "plain"
        finally:
            fcntl.lockf(self.lock_fd, fcntl.LOCK_UN, 1, 0)

    def agree(self, grads: list[torch.Tensor] | None, scale: float, joined: bool = False) -> int:
        """The bytes of the first bucket reduced early in this step (collective with the peer: both get the
        same number). ``grads``: this rank's gradients when it could work (None: it cannot, or has joined).

        Raises:
            ShmTransportError: the peer died, gave up, or did not stop within the channel's time-out.
        """
        s = self.step()
        if grads is not None:  # the peer reads and writes them: huge pages (as all_reduce_many does)
            _huge_pages.advise((g.data_ptr(), g.numel() * g.element_size()) for g in grads)
        role = self._arrive(s, grads is not None, joined)
        self.worked = role == "early"
        if role == "plain":
            return 0
        w = self.ch.words
        if role == "wait":
            HOOKS.paused += 1
            try:
                _wait_word(self.ch, self._s(1), s, 1 - self.ch.me)
            finally:
                HOOKS.paused -= 1
            return int(w[self._s(2)])
        assert grads is not None
        k = self._work(s, grads, scale)
        w[self._s(2)] = k
        self.ch._post(self._s(1), s)
        if k:
            STATS["steps"] += 1
            STATS["bytes"] += k
        return k

    def _work(self, s: int, grads: list[torch.Tensor], scale: float) -> int:
        w, peer = self.ch.words, 1 - self.ch.me
        if w[self._w(peer, 2)] != w[self._w(self.ch.me, 2)]:
            return 0  # the peer's owner has another layout
        mid, start = lerp_owner(self.total, grads[0].element_size(), 2), 0
        try:
            for i, nbytes in enumerate(self.sizes):
                if not self._ready(i, s) or w[self._w(peer, 3)] != _bits(scale):
                    break
                done = self._param(s, grads[i], start, w[self._mark(peer, i) + 1], scale, mid)
                start += done
                if done < nbytes:
                    break
        except OSError as e:
            self.ch._fail(f"cross-memory copy failed ({e})", s, "early gradient reduction")
        return start

    def _ready(self, i: int, s: int) -> bool:
        """Wait (at most ``WAIT_S``) until the peer marked gradient ``i``; False if it arrived or joined first."""
        w, peer = self.ch.words, 1 - self.ch.me
        k, deadline, spins = self._mark(peer, i), 0.0, 0
        while w[k] != s:
            if w[self._w(peer, 0)] >= s or w[self._w(peer, 1)] or w[0]:
                return False
            spins += 1
            if spins < SPIN:
                continue
            now = time.monotonic()  # then nap: a spinning worker would take a shared core from the peer
            if not deadline:
                deadline = now + WAIT_S
            elif now > deadline:
                return False
            time.sleep(NAP_S)
        return True

    def _param(self, s: int, grad: torch.Tensor, start: int, remote: int, scale: float, mid: int) -> int:
        """Reduce one parameter's gradient (virtual bytes from ``start``, the peer's at ``remote``) piece by
        piece into this rank's and the peer's; the bytes done (fewer when the peer arrived)."""
        ch, peer, size = self.ch, 1 - self.ch.me, grad.element_size()
        pid, nbytes = ch.words[ch._pid(peer)], grad.numel() * size
        theirs = ch.scratch_buffers(PIECE_BYTES)[peer]
        for a, b in _chunks(start, start + nbytes, PIECE_BYTES, mid):
            if ch.words[self._w(peer, 0)] >= s:
                return a - start
            at = remote + a - start
            _cross_memory.readv(pid, [(theirs.data_ptr(), at, b - a)])
            own = grad[(a - start) // size : (b - start) // size]
            combine(own, theirs[: b - a].view(grad.dtype), scale, ch.me == int(a >= mid))
            _cross_memory.writev(pid, [(own.data_ptr(), at, b - a)])
        return nbytes


def combine(own: torch.Tensor, theirs: torch.Tensor, scale: float, first: bool) -> None:
    """``own`` becomes what the 2-rank allreduce (``_many._reduce``, equal scales) gives these elements:
    ``(own + theirs) * scale``, as one ``lerp`` from the part owner's value (``first``: this rank's) for 0.5."""
    if scale == 0.5:
        if first:
            own.lerp_(theirs, 0.5)
        else:
            torch.lerp(theirs, own, 0.5, out=own)
        return
    own.add_(theirs)
    if scale != 1.0:
        own.mul_(scale)


def _wait_word(ch: Channel, k: int, g: int, j: int) -> None:
    """Wait until word ``k`` reaches ``g`` (the channel's time-out and dead-peer checks; ``j``: the peer)."""
    spins = 0
    while ch.words[k] < g and spins < SPIN:
        spins += 1
    if ch.words[k] < g:
        ch._wait_slow(k, g, j, "early gradient reduction")


def claim(ch: Channel | None, key: tuple[int, int], sizes: list[int], fingerprint: int) -> Area | None:
    """The channel's early-reduction area for the optimizer ``key`` (None when the channel cannot: not 2 ranks
    with cross-memory attach and wake-up FIFOs, or a bucket the plain path does not reduce with ``_many``).

    The last optimizer built on the channel owns it (every rank builds its optimizers in the same order): an
    earlier one's area is no longer :meth:`Area.active`, and that optimizer reduces as usual."""
    total = sum(sizes)
    if not enabled() or ch is None or ch.n != 2 or not ch.cma or ch.wake_r < 0 or len(ch.wake_w) != 2:
        return None
    if not _cross_memory.supported() or not eligible(ch, total):
        return None
    first = control_lines(ch.n) * LINE // 8
    cap = (layout(ch.n, ch.slot_bytes)[0] // 8 - first - _MARKS) // 4
    if cap < 1:
        return None
    lock_fd = ch.wake_r if ch.me == 0 else ch.wake_w[0]
    area = Area(ch, key, sizes[:cap], total, first, lock_fd)
    area.release()
    ch.words[area._w(ch.me, 2)] = fingerprint & ((1 << 62) - 1)
    _AREAS[ch] = area
    return area


def find(ch: Channel | None, key: tuple[int, int]) -> Area | None:
    """The area ``key`` claimed on ``ch`` (a joined rank answers its steps), or None."""
    area = _AREAS.get(ch) if ch is not None else None
    return area if area is not None and area.key == key else None
