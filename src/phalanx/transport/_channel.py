"""One shared-memory channel: the ranks of a group on one host, a control area and one slot per rank.

Layout (offsets from the channel's base, every counter on its own 64-byte line):

* line 0: the abort word (0, or 1 + the index of the rank that gave up);
* lines ``1 .. n``: ``arrive[i]``, the last step whose data rank ``i`` has put in its slot;
* lines ``n+1 .. 2n``: ``done[i]``, the last step whose data rank ``i`` has finished reading;
* lines ``2n+1 .. 3n``: ``pid[i]``, for the liveness check;
* lines ``3n+1 .. 4n``: ``addr[i]``, the address of rank ``i``'s own tensor in a cross-memory step;
* lines ``4n+1 .. 8n``: the chunk counters of a streamed step (:meth:`Channel.count`, ``_stream``);
* the rest of the control area's last page: spare (the grad channel's early-reduction words, ``_early``);
* then ``n`` slots of ``slot_bytes`` (page aligned).

Every collective is a sequence of *steps* numbered alike on every rank (all ranks issue the same
collectives in the same order). A step: wait until every peer finished reading the previous step
(``done >= g - 1``, so a slot is never overwritten while read), copy this rank's chunk into its slot,
publish ``arrive = g``, wait for every ``arrive >= g``, read the slots, publish ``done = g``. Counters are
aligned 8-byte words written once per step after the data (x86-64 keeps stores in order; a reader that sees
``arrive = g`` sees the slot's data), so a reader never sees a torn chunk. Every rank reduces the slots in
rank order, so every rank computes bit-identical results.

Waits spin briefly, yield briefly, then block in ``select`` on this rank's wake-up pipe (a FIFO every
peer writes a byte to after publishing a counter): the kernel wakes the waiter as soon as its peer
publishes, which matters when more processes than cores compete (two cores shared by every rank). A
missing wake-up costs at most ``CHECK_S`` (the counters are re-read after every wake-up or time-out),
and every ``CHECK_S`` check the abort word, a deadline and whether the peers' processes still exist.

The control area (its layout, the counters, the waits and failing alike) is ``_control.Control``, which
``Channel`` extends with the steps over the slots.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence

import torch

from phalanx.errors import ShmTransportError
from phalanx.transport import _cross_memory
from phalanx.transport._control import SPIN, Control, layout
from phalanx.transport._segment import Segment


class Channel(Control):
    """Steps of a group's ranks on one host over one region of a shared-memory segment.

    Args:
        seg: the mapped segment.
        base: the region's offset in the segment (page aligned).
        n: ranks on the channel; me: this rank's index among them.
        slot_bytes: bytes per rank slot (a multiple of 64).
        timeout_s: seconds one wait may take before ``ShmTransportError``.
        label: names the group in error messages.
        ranks: the ranks on the channel in index order, to name a peer in errors (empty: its index).
        knob: what raises ``timeout_s``, for the timeout's message.
    """

    def __init__(self, seg: Segment, base: int, n: int, me: int, slot_bytes: int, timeout_s: float,
                 label: str, ranks: Sequence[int] = (), knob: str = "PHALANX_SHM_TIMEOUT_S") -> None:
        super().__init__(seg, base, n, me, timeout_s, label, ranks, knob)
        self.slot_bytes = slot_bytes
        ctl, _total = layout(n, slot_bytes)
        self.slots = [
            torch.frombuffer(seg.buf, dtype=torch.uint8, count=slot_bytes, offset=base + ctl + i * slot_bytes)
            for i in range(n)
        ]
        self.gen = 0
        self._view_cache: dict[tuple[int, torch.dtype], list[torch.Tensor]] = {}
        self.cma = False  # cross-memory attach agreed by every rank (see :meth:`enable_cma`)
        self.scratch: list[torch.Tensor] = []  # pre-faulted per-peer buffers of cross-memory steps
        self.streamed = 0  # chunks of streamed steps so far (the chunk counters' base)
        self.rings: dict[tuple[torch.dtype, int], object] = {}  # ``_stream``'s views of the slots

    def close(self) -> None:
        """Release the counters' view (the slots go with their tensors)."""
        self._view_cache.clear()
        self.words.release()

    def _begin(self) -> int:
        if self.broken is not None:
            raise ShmTransportError(f"{self.broken}; the channel cannot be used after a failure")
        self.gen += 1
        self._wait_all(self._done, self.gen - 1, "slot reuse")
        return self.gen

    # --- steps ---------------------------------------------------------------------------------------

    def exchange(self, chunk: torch.Tensor, read: Callable[[list[torch.Tensor]], None], what: str,
                 dtype: torch.dtype = torch.uint8) -> None:
        """One all-to-all step: publish ``chunk`` (uint8), call ``read`` with every rank's slot viewed as
        ``dtype`` (``chunk``'s length must be a multiple of its element size)."""
        g = self._begin()
        views = self._views(chunk.numel(), dtype)
        views[self.n].copy_(chunk)
        self._post(self._arrive(self.me), g)
        self._wait_all(self._arrive, g, what)
        read(views[: self.n])
        self._post(self._done(self.me), g)

    def _views(self, nbytes: int, dtype: torch.dtype) -> list[torch.Tensor]:
        """Every slot's first ``nbytes`` as ``dtype``, then this rank's as bytes (cached: small steps repeat)."""
        key = (nbytes, dtype)
        views = self._view_cache.get(key)
        if views is None:
            if len(self._view_cache) >= 64:
                self._view_cache.clear()
            views = [s[:nbytes].view(dtype) for s in self.slots] + [self.slots[self.me][:nbytes]]
            self._view_cache[key] = views
        return views

    def exchange2(self, chunk: torch.Tensor, first: Callable[[list[torch.Tensor]], None],
                  second: Callable[[list[torch.Tensor]], None], what: str) -> None:
        """A two-phase step: publish ``chunk``; ``first`` (every rank sees every slot; it may write only its
        own part of its own slot); a barrier; ``second`` (reads only)."""
        g = self._begin()
        nbytes = chunk.numel()
        views = [s[:nbytes] for s in self.slots]
        views[self.me].copy_(chunk)
        self._post(self._arrive(self.me), g)
        self._wait_all(self._arrive, g, what)
        first(views)
        self.gen = g = g + 1
        self._post(self._arrive(self.me), g)
        self._wait_all(self._arrive, g, what)
        second(views)
        self._post(self._done(self.me), g)

    def publish(self, root: int, chunk: torch.Tensor, out: torch.Tensor, what: str) -> None:
        """One broadcast step: the root publishes ``chunk`` (uint8); the others copy it into ``out``."""
        g = self._begin()
        if self.me == root:
            self.slots[root][: chunk.numel()].copy_(chunk)
            self._post(self._arrive(root), g)
        else:
            self._wait_one(root, g, what)
            out.copy_(self.slots[root][: out.numel()])
        self._post(self._done(self.me), g)

    def barrier(self) -> None:
        """Return once every rank of the channel reached this step."""
        g = self._begin()
        self._post(self._arrive(self.me), g)
        self._wait_all(self._arrive, g, "barrier")
        self._post(self._done(self.me), g)

    # --- streamed steps (``_stream``) ----------------------------------------------------------------

    def count(self, kind: int, i: int) -> int:
        """The index in :attr:`words` of rank ``i``'s chunk counter ``kind`` (0 .. ``COUNTERS`` - 1)."""
        return (1 + (4 + kind) * self.n + i) * 8

    def stream_begin(self) -> int:
        """Start a streamed step: once every peer finished the previous step (every slot is free), return
        the chunk counters' common base (chunks streamed by earlier steps, alike on every rank)."""
        self._begin()
        return self.streamed

    def stream_end(self, chunks: int) -> None:
        """End a streamed step of ``chunks`` chunks: this rank read every slot it needed (``done``)."""
        self.streamed += chunks
        self._post(self._done(self.me), self.gen)

    def post_count(self, kind: int, value: int) -> None:
        """Publish this rank's chunk counter ``kind`` (after the data it counts); wake the peers."""
        self._post(self.count(kind, self.me), value)

    def wait_counts(self, kind: int, value: int, what: str) -> None:
        """Wait until every peer's chunk counter ``kind`` reaches ``value`` (checks as every wait)."""
        words = self.words
        for j in range(self.n):
            k = self.count(kind, j)
            if j == self.me or words[k] >= value:
                continue
            spins = 0
            while words[k] < value and spins < SPIN:
                spins += 1
            if words[k] < value:
                self._wait_slow(k, value, j, what, self.gen)

    # --- cross-memory attach -------------------------------------------------------------------------

    def enable_cma(self, wanted: bool) -> bool:
        """Probe cross-memory reads between every pair of ranks; use them only if every rank can (collective).

        Every rank publishes the address of a word holding its pid; every rank reads each peer's word with
        ``process_vm_readv``; the outcome (and ``wanted``) is agreed through the ``addr`` words.
        """
        probe = torch.tensor([os.getpid()], dtype=torch.int64)
        self.words[self._addr(self.me)] = probe.data_ptr()
        self.barrier()
        ok = wanted and _cross_memory.supported()
        for j in range(self.n):
            pid, addr = self.words[self._pid(j)], self.words[self._addr(j)]
            if ok and j != self.me:
                ok = _cross_memory.probe(pid, addr, pid.to_bytes(8, "little", signed=True))
        self.barrier()  # every rank finished reading the probes
        self.words[self._addr(self.me)] = int(ok)
        self.barrier()
        self.cma = all(self.words[self._addr(j)] for j in range(self.n))
        self.barrier()  # every rank read the outcome before the words are reused
        return self.cma

    def attach_step(self, addr: int, first: Callable[[list[tuple[int, int]]], None],
                    second: Callable[[list[tuple[int, int]]], None], what: str) -> None:
        """A two-phase step on the ranks' own buffers: publish ``addr``; ``first`` with every rank's
        (pid, address) (it may read the peers' buffers and write only its own part of its own); a barrier;
        ``second`` (it may write its own buffer outside its own part); return once every rank finished
        reading (the caller's buffer is its own again)."""
        g = self._begin()
        self.words[self._addr(self.me)] = addr
        self._post(self._arrive(self.me), g)
        self._wait_all(self._arrive, g, what)
        peers = [(self.words[self._pid(j)], self.words[self._addr(j)]) for j in range(self.n)]
        self._guarded(first, peers, g, what)
        self.gen = g = g + 1
        self._post(self._arrive(self.me), g)
        self._wait_all(self._arrive, g, what)
        self._guarded(second, peers, g, what)
        self._post(self._done(self.me), g)
        self._wait_all(self._done, g, what)

    def _guarded(self, fn: Callable[[list[tuple[int, int]]], None], peers: list[tuple[int, int]], g: int,
                 what: str) -> None:
        try:
            fn(peers)
        except OSError as e:
            self._fail(f"cross-memory read failed ({e})", g, what)

    def scratch_buffers(self, nbytes: int) -> list[torch.Tensor]:
        """``n`` pre-faulted byte buffers of ``nbytes`` (kept and reused: a first touch costs a page fault)."""
        if not self.scratch or self.scratch[0].numel() < nbytes:
            self.scratch = [torch.zeros(nbytes, dtype=torch.uint8) for _ in range(self.n)]
        return self.scratch
