"""Collectives of a group whose ranks may span hosts: shared memory within each host, gloo among the hosts'
leaders (Horovod's hierarchical allreduce).

The ranks of the group on one host share a :class:`~phalanx.transport._channel.Channel` (None when the host
has only one of them); the first of them is the host's *leader*, the only one that talks to other hosts,
through ``leaders``: a gloo process group of every host's leader, ranked by host (None on the other ranks and
on a single-host group). Used by phalanx.torch's payload collectives (``_dispatch``) and by the
``phalanx_shm`` torch backend (``backend``). Functions take flat contiguous CPU tensors and return when done.

A failure of a leader's gloo step breaks its host's channel (``Channel.abort``): the leader's peers, waiting
for it to share the result, fail at their next check with an error naming it instead of waiting out the
time-out.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from functools import partial
from typing import Any

import torch
import torch.distributed as dist

from phalanx.errors import CollectiveMismatchError, ShmTransportError
from phalanx.transport import _ops, _reduce_scatter
from phalanx.transport._channel import Channel
from phalanx.transport._control import HOOKS

ReduceOp = dist.ReduceOp
# From this size on, allreduces cross hosts part by part (when ``cross`` is set): below it the leaders' one
# crossing costs less than the extra steps in the host; above it every rank carrying a part wins
# (bench/shm.py's AABB rows).
PART_BYTES = 2 << 20


@dataclass
class Hierarchy:
    """One rank's view of its group's layout.

    Attributes:
        ch: the channel of this host's ranks of the group (None: this rank is alone on its host).
        leaders: the leaders' gloo group on a leader of a multi-host group, else None.
        multi: whether the group spans hosts.
        size: ranks in the group.
        rank: this rank's index in the group.
        hosts: the group ranks of each host, hosts ordered by their first rank (the leaders' ranks); needed
            by :meth:`broadcast_` and :meth:`allgather_` only.
        cross: when every host has as many ranks of the group, the gloo group of the ranks with this rank's
            index on their host (ranked by host), else None. Allreduces of at least ``PART_BYTES`` then cross
            hosts part by part, every rank carrying its own part in parallel (a reduce-scatter in the host, an
            allreduce of each part among the hosts, an allgather in the host: Horovod's hierarchical
            allreduce) instead of all of it through the leaders.
    """

    ch: Channel | None
    leaders: Any
    multi: bool
    size: int
    rank: int = 0
    hosts: tuple[tuple[int, ...], ...] = ()
    cross: Any = None

    def _host(self, rank: int) -> int:
        return next(i for i, h in enumerate(self.hosts) if rank in h)

    def _cross(self, what: str, call: Callable[[], Any]) -> None:
        """Run a leaders' gloo call to its end; on failure break this host's channel and raise naming it."""
        try:
            call()
        except CollectiveMismatchError as e:  # the wait hooks' verdict: raised as is, peers fail too
            if self.ch is not None:
                self.ch.abort(f"the {what} across hosts was abandoned: {e}")
            raise
        except Exception as e:
            cause = f"the {what} across hosts (gloo among the hosts' leaders) failed: {e}"
            if self.ch is not None:
                self.ch.abort(cause)
            pending = HOOKS.pending() if HOOKS.pending is not None and not HOOKS.paused else None
            # A leaders' gloo failure is a peer host's rank that died or diverged, not the transport: no hint to
            # turn shared memory off.
            lead = f"{pending} cannot complete" if pending else "hierarchical collective failed"
            raise ShmTransportError(f"{lead}: {cause}") from e

    def allreduce_(self, t: torch.Tensor, op: Any) -> None:
        """Reduce ``t`` in place: within the host, among the leaders, then shared within the host.
        ``AVG`` is a sum divided by the group size."""
        if _ops._kind(op) == ReduceOp.AVG:
            self.allreduce_(t, ReduceOp.SUM)
            (torch.view_as_real(t) if t.is_complex() else t).div_(self.size)  # per component, as gloo
            return
        if not self.multi:
            if self.ch is not None:
                _ops.allreduce_(self.ch, t, op)
            return
        if t.numel() == 0:
            return
        big = t.numel() * t.element_size() >= PART_BYTES
        if big and self.cross is not None and self.ch is not None and _ops.uses_cma(self.ch, t):
            if _gloo_native(t):
                self._allreduce_pipelined(t, op)
                return
            cross = self.cross
            _ops.allreduce_cma_(self.ch, t, op, lambda part: self._cross("allreduce",
                                                                         lambda: _leaders_allreduce(cross, part, op)))
            return
        if self.ch is not None:
            _ops.allreduce_(self.ch, t, op)
        if self.leaders is not None:
            self._cross("allreduce", lambda: _leaders_allreduce(self.leaders, t, op))
        if self.ch is not None:
            _ops.broadcast_(self.ch, t.view(torch.uint8), 0)

    def _allreduce_pipelined(self, t: torch.Tensor, op: Any) -> None:
        """The part-by-part crossing with the network overlapping the host: each piece of this rank's part
        starts its gloo allreduce among the hosts (asynchronously, in the same order on every rank) as soon
        as the host has reduced it, while the next piece is reduced; the part is shared in the host once
        every piece came back. The network, slower than memory between real hosts, then hides the in-host
        reduction instead of following it."""
        cross, works, opts = self.cross, [], dist.AllreduceOptions()
        opts.reduceOp = _ops._kind(op)  # type: ignore[assignment]  # a ReduceOp (RedOpType) at run time
        run = [0, 0]  # [start, stop) in ``t`` of the reduced pieces not sent yet
        base = int(t.storage_offset())

        def send(piece: torch.Tensor) -> None:
            lo = int(piece.storage_offset()) - base
            if run[1] != lo:  # pieces come in order and cover the part: a gap starts a new run
                flush()
                run[0] = lo
            run[1] = lo + piece.numel()
            if (run[1] - run[0]) * t.element_size() >= NET_PIECE_BYTES:
                flush()

        def flush() -> None:
            if run[1] > run[0]:
                works.append(cross.allreduce([t[run[0] : run[1]]], opts))
            run[0] = run[1]

        def between(_part: torch.Tensor) -> None:
            flush()
            for w in works:
                self._cross("allreduce", partial(wait, w))

        assert self.ch is not None
        _ops.allreduce_cma_(self.ch, t, op, between, send)

    def broadcast_(self, t: torch.Tensor, root: int) -> None:
        """Copy group rank ``root``'s ``t`` (flat uint8) to every rank: within the root's host, among the
        leaders, within the other hosts."""
        if not self.multi:
            if self.ch is not None:
                _ops.broadcast_(self.ch, t, self.hosts[0].index(root) if self.hosts else root)
            return
        if t.numel() == 0:
            return
        root_host, mine = self._host(root), self._host(self.rank)
        if self.ch is not None and mine == root_host:
            _ops.broadcast_(self.ch, t, self.hosts[mine].index(root))
        if self.leaders is not None:
            opts = dist.BroadcastOptions()
            opts.rootRank = root_host
            self._cross("broadcast", lambda: wait(self.leaders.broadcast([t], opts)))
        if self.ch is not None and mine != root_host:
            _ops.broadcast_(self.ch, t, 0)

    def barrier(self) -> None:
        """Return once every rank of the group arrived."""
        if self.ch is not None:
            self.ch.barrier()
        if self.leaders is not None:
            self._cross("barrier", lambda: wait(self.leaders.barrier(dist.BarrierOptions())))
        if self.multi and self.ch is not None:
            self.ch.barrier()

    def allgather_(self, out: torch.Tensor, inp: torch.Tensor) -> None:
        """Gather every rank's ``inp`` (flat uint8, equal sizes; it may be this rank's part of ``out``) into
        ``out`` in group rank order.

        Across hosts, when every host holds a contiguous run of as many group ranks (AABB): an allgather in
        the host into its block of ``out``, a gloo allgather of the blocks among the leaders, the other
        blocks shared in the host. Any other layout (ABA, AAB): ``out`` zeroed but for this rank's part, then
        a bitwise-or allreduce (exact for any bytes, twice the data through the leaders)."""
        if not self.multi:
            if self.ch is not None:
                _ops.allgather_(self.ch, out, inp)
            return
        m, r = inp.numel(), self.rank
        if m and self._blocks_even():
            self._allgather_blocks(out, inp)
            return
        out[: r * m].zero_()  # not all of it: FSDP2 passes its own part of ``out`` as ``inp``
        out[(r + 1) * m :].zero_()
        out[r * m : (r + 1) * m].copy_(inp)
        self.allreduce_(out, ReduceOp.BOR)

    def reduce_scatter_path(self, inp: torch.Tensor, op: Any) -> str:
        """How :meth:`reduce_scatter_` reduces ``inp`` (common knowledge: every rank decides alike).

        ``"direct"``: one host with cross-memory attach, each rank sums its part straight from its peers'
        inputs (``_reduce_scatter``). ``"hosts"``: from ``PART_BYTES`` on, hosts with as many ranks each
        (``cross`` set),
        see :meth:`_reduce_scatter_hosts` (faster than the copy from ``PART_BYTES`` on, bench/shm.py's AABB
        rows). ``"copy"``: an allreduce of a copy of ``inp``, of which each rank
        keeps its part (twice a reduce-scatter's traffic)."""
        if not self.multi:
            ch = self.ch
            direct = ch is not None and _reduce_scatter.eligible(ch, inp.numel() * inp.element_size())
            return "direct" if direct else "copy"
        big = inp.numel() * inp.element_size() >= PART_BYTES  # smaller: one gloo call among the leaders is faster
        return "hosts" if big and self.cross is not None and self.ch is not None else "copy"

    def reduce_scatter_(self, out: torch.Tensor, inp: torch.Tensor, op: Any, path: str) -> None:
        """``out`` = this rank's part (group rank order) of the reduction of every rank's ``inp`` (flat,
        contiguous, one dtype; ``inp`` has ``size`` times ``out``'s elements), the way ``path``
        (:meth:`reduce_scatter_path`) says. ``AVG`` is a sum divided by the group size."""
        if _ops._kind(op) == ReduceOp.AVG:
            self.reduce_scatter_(out, inp, ReduceOp.SUM, path)
            (torch.view_as_real(out) if out.is_complex() else out).div_(self.size)  # per component, as gloo
            return
        if path == "direct":
            assert self.ch is not None
            _reduce_scatter.reduce_scatter_(self.ch, out, inp, op)
        elif path == "hosts":
            self._reduce_scatter_hosts(out, inp, op)
        else:
            tmp, n = inp.clone(), out.numel()
            self.allreduce_(tmp, op)
            out.copy_(tmp[self.rank * n : (self.rank + 1) * n])

    def _reduce_scatter_hosts(self, out: torch.Tensor, inp: torch.Tensor, op: Any) -> None:
        """Hierarchical reduce-scatter (``op`` not ``AVG``) over hosts of ``k`` ranks each. Local rank ``j``
        reduces over its host the part of each host's ``j``-th rank, one after the other into a block (host
        order); an allreduce among the ranks of local index ``j`` (``cross``, one per host) sums the block over
        the hosts, and each rank keeps its part. Every rank carries ``1/k`` of the data across hosts, all in
        parallel, as the allreduce's part-by-part crossing does, with neither a copy of ``inp`` nor an
        allgather in the host. (An allreduce rather than gloo's own reduce-scatter, which is the slower of the
        two on CPU.)"""
        kind: Any = _ops._kind(op)
        m, hosts, ch, cross = out.numel(), self.hosts, self.ch, self.cross
        assert ch is not None and cross is not None  # reduce_scatter_path chose "hosts"
        mine = self._host(self.rank)
        j = hosts[mine].index(self.rank)
        block = torch.empty(len(hosts) * m, dtype=inp.dtype)
        if _reduce_scatter.eligible(ch, inp.numel() * inp.element_size()):
            _reduce_scatter.reduce_scatter_(ch, block, inp, kind, parts=[host[j] * m for host in hosts])
        else:
            total = inp.clone()
            _ops.allreduce_(ch, total, kind)
            torch.cat([total[host[j] * m : (host[j] + 1) * m] for host in hosts], out=block)
        self._cross("reduce-scatter", lambda: _leaders_allreduce(cross, block, kind))
        out.copy_(block[mine * m : (mine + 1) * m])

    def _blocks_even(self) -> bool:
        """Whether every host holds a contiguous run of the same number of group ranks (common knowledge)."""
        k = len(self.hosts[0]) if self.hosts else 0
        return k > 0 and all(h == tuple(range(h[0], h[0] + k)) for h in self.hosts)

    def _allgather_blocks(self, out: torch.Tensor, inp: torch.Tensor) -> None:
        m, hosts = inp.numel(), self.hosts
        mine = hosts[self._host(self.rank)]
        lo, hi = mine[0] * m, (mine[-1] + 1) * m
        block = out[lo:hi]
        if self.ch is not None:
            _ops.allgather_(self.ch, block, inp)
        else:
            block.copy_(inp)
        if self.leaders is not None:
            self._cross("allgather", lambda: wait(self.leaders._allgather_base(out, block)))
        if self.ch is not None:
            for part in (out[:lo], out[hi:]):
                if part.numel():
                    _ops.broadcast_(self.ch, part, 0)


SLICE = timedelta(seconds=1)  # a leader's gloo wait consults the wait hooks this often once slow


def wait(work: Any) -> None:
    """``work.wait()`` of a leaders' gloo step, consulting the wait hooks (``HOOKS``) as the channel's own
    waits do: a leader blocked among hosts publishes what it waits for, so a deadlock across process sets
    that involves it is found and raised (``CollectiveMismatchError``) instead of waiting out gloo's time-out."""
    if HOOKS.stalled is None or HOOKS.paused:
        work.wait()
        return
    start, stalled = time.monotonic(), False
    try:
        while not _timed_wait(work):
            stalled = True
            error = HOOKS.stalled(time.monotonic() - start)
            if error is not None:
                raise error
    finally:
        if stalled and HOOKS.resumed is not None:
            HOOKS.resumed()


def _timed_wait(work: Any) -> bool:
    """``work.wait(SLICE)``; False when the slice ran out (a failed work raises its own error, or the
    hooks' verdict when a deadlocked peer raised and left first)."""
    try:
        work.wait(SLICE)
        return True
    except RuntimeError:
        if not work.is_completed():
            return False
    try:
        work.wait()
    except Exception as e:
        verdict = HOOKS.verdict() if HOOKS.verdict is not None else None
        if verdict is not None:
            raise verdict from e
        raise
    return True


# gloo has no bool reductions: bools cross as bytes 0 / 1 (or = max, and = min), as the channel reduces them
_BOOL_OPS = {ReduceOp.SUM: ReduceOp.MAX, ReduceOp.MAX: ReduceOp.MAX, ReduceOp.BOR: ReduceOp.MAX,
             ReduceOp.PRODUCT: ReduceOp.MIN, ReduceOp.MIN: ReduceOp.MIN, ReduceOp.BAND: ReduceOp.MIN,
             ReduceOp.BXOR: ReduceOp.BXOR}


# Pieces of a pipelined crossing (``Hierarchy._allreduce_pipelined``): large enough that gloo's per-call cost
# is small beside the transfer, small enough that the first piece leaves the host early.
NET_PIECE_BYTES = 4 << 20
_GLOO_NATIVE = (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int32, torch.int64,
                torch.uint8, torch.int8)


def _gloo_native(t: torch.Tensor) -> bool:
    """Whether gloo reduces ``t``'s dtype as it is (no widening or view: :func:`_leaders_allreduce`)."""
    return t.dtype in _GLOO_NATIVE


def _leaders_allreduce(leaders: Any, t: torch.Tensor, op: Any) -> None:
    kind: Any = _ops._kind(op)
    wire = t
    if t.dtype == torch.bool:
        wire, kind = t.view(torch.uint8), _BOOL_OPS[kind]
    elif t.is_complex():  # as dist.all_reduce hands complex tensors to gloo (sums only)
        wire = torch.view_as_real(t)
    elif t.dtype == torch.int16:  # gloo has no int16: widened (wrap-around sums / products agree mod 2**16)
        wire = t.to(torch.int32)
    opts = dist.AllreduceOptions()
    opts.reduceOp = kind
    wait(leaders.allreduce([wire], opts))
    if wire.data_ptr() != t.data_ptr():  # widened: a copy
        t.copy_(wire)
