"""``hvd.join()`` with Horovod's semantics: a rank that has joined serves the other ranks' allreduces.

A joined rank keeps sending ``join`` control blocks on the global process set. In a round where some blocks
say ``join`` and the others agree on a collective (common knowledge: every rank sees every block):

* a single-tensor **allreduce**: the live ranks run it; each joined rank contributes the op's identity
  (zeros for Sum/Average, as Horovod, whose Average still divides by the full size; ones for Product;
  the dtype's extreme for Min/Max), on the same payload path (inline, speculative or data group);
* a ``DistributedOptimizer`` **step** (the block ``synchronize()`` sends first): each joined rank
  allreduces zero buckets of the optimizer's layout (registered at construction, identical on every rank)
  on the gradient group, so uneven numbers of batches per rank finish without deadlock;
* anything else (allgather, broadcast, alltoall, reducescatter, barrier, grouped allreduce): the live
  ranks raise ``CollectiveMismatchError`` (Horovod raises too); the joined ranks keep waiting.

When every block says ``join``, every rank returns the global rank that joined last (the latest round,
then the latest wall clock).
"""

from __future__ import annotations

import time
from typing import Any

import torch

from phalanx.errors import CollectiveMismatchError
from phalanx.torch._engine import header
from phalanx.torch._engine import reduce as reduction
from phalanx.torch._engine import speculate as speculation
from phalanx.torch._engine.collective import Entry
from phalanx.torch._engine.collectives import Allreduce, Barrier
from phalanx.torch._runtime import RUNTIME
from phalanx.torch._setup import state as _state
from phalanx.torch.compression import Compressor


def register_layout(psid: int, buckets: list[tuple[int, torch.dtype, torch.device]],
                    compression: type[Compressor]) -> int:
    """Record a DistributedOptimizer's bucket layout on set ``psid``; returns its id (sent in its step blocks:
    every member builds the set's optimizers in the same order, so the ids agree)."""
    layouts = RUNTIME.layouts.setdefault(psid, [])
    layouts.append((buckets, compression))
    return len(layouts) - 1


class OptimizerStep(Barrier):
    """The block a DistributedOptimizer sends before waiting for its buckets (no payload)."""


def identity(sig: header.Signature) -> torch.Tensor:
    """The tensor a joined rank contributes to an allreduce of ``sig``: the op's identity."""
    device = torch.device("cuda") if sig.device else torch.device("cpu")
    dtype, op = sig.dtype, sig.op
    if isinstance(dtype, str):
        raise CollectiveMismatchError(f"a rank's allreduce has {dtype}, which this rank's torch {torch.__version__} "
                                      "lacks: every rank must run the same torch")
    if op in (reduction.Sum, reduction.Average) or (dtype == torch.bool and op == reduction.Max):
        return torch.zeros(sig.shape, dtype=dtype, device=device)
    if op == reduction.Product or dtype == torch.bool:
        return torch.ones(sig.shape, dtype=dtype, device=device)
    info: Any = torch.finfo(dtype) if dtype.is_floating_point else torch.iinfo(dtype)
    extreme = (float("inf") if op == reduction.Min else float("-inf")) if dtype.is_floating_point else None
    value = extreme if extreme is not None else (info.max if op == reduction.Min else info.min)
    return torch.full(sig.shape, value, dtype=dtype, device=device)


class Join(Barrier):
    """One round of a joined rank: serves the live ranks' collective, or ends the join (``result``)."""

    def __init__(self, sig: header.Signature, joined_at: int) -> None:
        super().__init__(sig)
        self.joined_at = joined_at
        self.result: int | None = None
        self.works: list[Any] = []
        self.served: Allreduce | None = None

    def aux(self) -> list[int]:
        return [self.joined_at, time.time_ns()]

    def run_inline(self, payloads: list[torch.Tensor], sigs: list[header.Signature], aux: list[list[int]]) -> None:
        arrivals = [(row[0], row[1]) for row in aux]
        self.result = arrivals.index(max(arrivals))  # an index: join() maps it to a global rank

    def serve_allreduce(self, groups: Any, sig: header.Signature, n: int) -> None:
        ident = identity(sig)
        self.served = Allreduce([ident], [ident], sig.op, 1.0, 1.0, n, sig)
        self.served.issue(groups, [], [])

    def serve_step(self, groups: Any, sig: header.Signature) -> None:
        layouts = RUNTIME.layouts.get(sig.process_set_id, [])
        if not 0 <= sig.root < len(layouts):
            raise CollectiveMismatchError(
                f"rank {_state.topology().rank} has joined and was asked to serve DistributedOptimizer "
                f"{sig.root} of process set {sig.process_set_id}, which it never built; every rank must build "
                "the same DistributedOptimizers in the same order"
            )
        buckets, compression = layouts[sig.root]
        area = groups.grad.early_find((sig.process_set_id or 0, sig.root))
        for i, (numel, dtype, device) in enumerate(buckets):
            wire, _ = compression.compress(torch.zeros(numel, dtype=dtype, device=device))
            k = area.agree(None, 1.0, joined=True) if i == 0 and area is not None else 0
            if k:  # the live rank reduced bytes before k early (with this rank's last marked gradients)
                nbytes = numel * wire.element_size()
                work = groups.grad.barrier() if k >= nbytes else None
                self.works.append(work or groups.grad.all_reduce_many([wire], 1.0, False, nbytes, start=k))
                continue
            self.works.append(groups.grad.all_reduce(wire))

    def finish(self) -> Any:
        for work in self.works:
            work.wait()
        if self.served is not None:
            self.served.finish()
        return self.result


def _supported(lead: header.Signature) -> bool:
    single = lead.count == 1 and lead.group_hash == 0
    return lead.kind == "optimizer step" or (lead.kind == "allreduce" and single)


def _refusal(lead: header.Signature, joined: list[int], detail: str | None, live_sigs: list[header.Signature],
             live_ranks: list[int]) -> CollectiveMismatchError:
    if detail is not None:
        return header.mismatch_error(live_sigs, live_ranks, detail, _state.topology().rank)
    return CollectiveMismatchError(
        f"rank(s) {joined} called hvd.join() while ranks {live_ranks} issued {lead.kind} of tensor "
        f"{lead.name or '<unnamed>'!r}: while a rank is joined the others may only run single-tensor "
        "allreduces and DistributedOptimizer steps on the global process set (as in Horovod); the collective "
        "was not run"
    )


def _speculated(entry: Entry, live: list[int], sigs: list[header.Signature], lead: header.Signature, ok: bool) -> bool:
    """Settle a speculative payload: True when it was the allreduce (the joined ranks sent zeros)."""
    if entry.spec is None:
        return False
    key, buffer, work = entry.spec
    entry.spec = None
    usable = ok and lead.kind == "allreduce" and lead.op in (reduction.Sum, reduction.Average)
    if usable and all(speculation.key_of(sigs[i]) == key for i in live):
        if isinstance(entry.coll, Join):
            work.wait()
            speculation.release(buffer)
        else:
            entry.coll.adopt(buffer, work)
        return True
    work.wait()
    speculation.release(buffer)
    return False


def negotiated(entry: Entry, sigs: list[header.Signature], ranks: list[int], rows: torch.Tensor) -> None:
    """Handle a round in which some ranks sent ``join`` blocks and others did not (see the module doc)."""
    assert entry.groups is not None
    live = [i for i, s in enumerate(sigs) if s.kind != "join"]
    joined = [ranks[i] for i, s in enumerate(sigs) if s.kind == "join"]
    lead, coll, n = sigs[live[0]], entry.coll, len(ranks)
    live_sigs, live_ranks = [sigs[i] for i in live], [ranks[i] for i in live]
    detail = header.find_mismatch(live_sigs, live_ranks)
    ok = detail is None and _supported(lead)
    entry.state = "done"
    if _speculated(entry, live, sigs, lead, ok):
        entry.state = "done" if isinstance(coll, Join) else "running"
        return
    try:
        if not ok:
            if not isinstance(coll, Join):
                raise _refusal(lead, joined, detail, live_sigs, live_ranks)
            return
        if lead.kind == "optimizer step":
            if isinstance(coll, Join):
                coll.serve_step(entry.groups, lead)
            return
        _allreduce_round(entry, live, live_sigs, rows, n)
    except Exception as e:
        entry.error = e


def _allreduce_round(entry: Entry, live: list[int], live_sigs: list[header.Signature], rows: torch.Tensor,
                     n: int) -> None:
    assert entry.groups is not None
    coll = entry.coll
    nbytes = [int(rows[i, header.F_NBYTES]) for i in live]
    if all(b >= 0 for b in nbytes):  # inline: only the live ranks' rows count (the identity adds nothing)
        if not isinstance(coll, Join):
            start = header.HEADER_WORDS + n
            payloads = [rows[i, start:].view(torch.uint8)[:b] for i, b in zip(live, nbytes)]
            coll.run_inline(payloads, live_sigs, [])
        return
    if isinstance(coll, Join):
        coll.serve_allreduce(entry.groups, live_sigs[0], n)
    else:
        coll.issue(entry.groups, live_sigs, [])
        entry.state = "running"
