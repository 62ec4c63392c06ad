"""Collectives matched across ranks by name, as Horovod's coordinator matches them (``_rounds``' slow path).

The engine negotiates one control block per rank and round. When every block of a round names the same
collective (the same name, or unnamed on every rank) it runs at once: the fast path. When they differ
(rank 0 issued ``allreduce(name='a')`` while rank 1 is in a barrier), every member records the round in the
membership's ``Table`` instead of raising; the table is the same on every member, since it is built only
from the gathered blocks:

* a named collective is keyed by its name; an unnamed one by its index among the unnamed collectives its
  rank issued since the table was created (Horovod's ``noname.<n>``: unnamed collectives match by order);
* a key that every member has issued is *ready*: it runs on every rank (signature check, inline result or
  payload), ready keys in the order they entered the table, so their payloads meet in the same order on
  the data group;
* a key that some member has not issued is *pending*: the rank that issued it goes on, and its later
  rounds (its next collectives, or the ``wait`` blocks it sends while blocked in ``synchronize``) fill the
  table until the key is ready.

A round in which every member sends a *blocking* ``wait`` block cannot make progress (no member can issue
anything new): every pending collective of the membership fails with ``CollectiveMismatchError`` on every
rank, naming what each rank waits for, and the table is cleared. While a table exists the engine launches
no speculative payload (every member knows it); it is deleted when nothing is pending.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from phalanx.torch._engine import header
from phalanx.torch._engine.collective import Entry
from phalanx.torch._engine.collectives import Barrier

Key = tuple[str, object]
BLOCKED = 1  # the ``root`` field of a wait block sent from ``synchronize`` (0: from ``poll``)


class Wait(Barrier):
    """The block of a rank that has nothing new to issue but waits for a parked collective.

    Args:
        awaited: the parked collective's signature (its name and process set are shown in errors).
        blocked: sent from ``synchronize`` (True) or from ``poll`` (False: the rank may issue more).
    """

    def __init__(self, awaited: header.Signature, blocked: bool) -> None:
        super().__init__(header.Signature("wait", awaited.name, torch.uint8, 0, (), root=BLOCKED if blocked else 0,
                                     process_set_id=awaited.process_set_id))


@dataclass
class Table:
    """One membership's pending collectives (identical on every member), and this rank's own entries.

    Attributes:
        n: the membership's size.
        pending: key -> member index -> (that member's control block row, its signature).
        mine: key -> this rank's entry, for every pending key this rank issued.
        unnamed: per member, the unnamed collectives it issued since the table was created.
    """

    n: int
    pending: dict[Key, dict[int, tuple[torch.Tensor, header.Signature]]] = field(default_factory=dict)
    mine: dict[Key, Entry] = field(default_factory=dict)
    unnamed: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.unnamed = [0] * self.n

    def key(self, index: int, sig: header.Signature) -> Key:
        """The key of member ``index``'s collective ``sig`` (counts its unnamed ones)."""
        if sig.name:
            return ("name", sig.name)
        count = self.unnamed[index]
        self.unnamed[index] = count + 1
        return ("unnamed", count)


@dataclass
class Outcome:
    """What a round decided: the entries to run now (with every member's row and signature, in member
    order), and the entries that failed because the membership is deadlocked (``error``)."""

    ready: list[tuple[Entry, list[torch.Tensor], list[header.Signature]]] = field(default_factory=list)
    failed: list[Entry] = field(default_factory=list)
    error: str = ""


ORDERED = ("join", "optimizer step")  # match by position: their rank goes on outside the engine at once


def ordered(sigs: list[header.Signature]) -> bool:
    """Whether a round holds a block of a kind matched by position, never parked: a ``DistributedOptimizer``
    step (its rank then waits for its buckets outside the engine) or a ``join``."""
    return any(s.kind in ORDERED for s in sigs)


def shown(table: Table, sigs: list[header.Signature]) -> list[header.Signature]:
    """The round's signatures for an error message: a wait block stands for the first collective its rank
    has pending."""
    first: dict[int, header.Signature] = {}
    for parts in table.pending.values():
        for i, (_, sig) in parts.items():
            first.setdefault(i, sig)
    return [first.get(i, s) if s.kind == "wait" else s for i, s in enumerate(sigs)]


def same_key(sigs: list[header.Signature]) -> bool:
    """Whether every block of a round names the same collective (the engine's usual path applies)."""
    first = sigs[0].name
    return all(s.name == first and s.kind != "wait" for s in sigs)


def add_round(table: Table, entry: Entry, me: int, rows: list[torch.Tensor], sigs: list[header.Signature],
              ranks: list[int]) -> Outcome:
    """Record one round's blocks in ``table`` and decide what runs.

    Args:
        table: the membership's table.
        entry: this rank's entry of the round (parked when its key is not ready; done for a wait).
        me: this rank's index in the membership.
        rows: every member's block, in member order.
        sigs: every member's signature.
        ranks: the membership's global ranks.
    """
    progress = False
    for i, sig in enumerate(sigs):
        if sig.kind == "wait":
            continue
        progress = True
        key = table.key(i, sig)
        table.pending.setdefault(key, {})[i] = (rows[i], sig)
        if i == me:
            table.mine[key] = entry
            entry.state = "parked"
    if entry.coll.sig.kind == "wait":
        entry.state = "done"
    out = Outcome()
    for key in [k for k, parts in table.pending.items() if len(parts) == table.n]:
        parts = table.pending.pop(key)
        out.ready.append((table.mine.pop(key), [parts[i][0] for i in range(table.n)],
                          [parts[i][1] for i in range(table.n)]))
    if not progress and all(s.root == BLOCKED for s in sigs):
        out.error = deadlock_message(table, ranks)
        out.failed = list(table.mine.values())
        table.pending.clear()
        table.mine.clear()
    return out


def deadlock_message(table: Table, ranks: list[int]) -> str:
    """Describe a membership whose every member waits for a collective another member never issued."""
    first: list[header.Signature | None] = [None] * table.n
    lines = []
    for key, parts in table.pending.items():
        sig = next(iter(parts.values()))[1]
        label = repr(key[1]) if key[0] == "name" else f"<unnamed #{key[1]}>"
        missing = [ranks[i] for i in range(table.n) if i not in parts]
        lines.append(f"{sig.kind} {label} issued by rank(s) {[ranks[i] for i in sorted(parts)]}, not by {missing}")
        for i, (_, s) in parts.items():
            first[i] = first[i] or s
    known = [s for s in first if s is not None]
    detail = header.find_mismatch(known, [r for r, s in zip(ranks, first) if s is not None]) if known else None
    names = " / ".join(sorted({repr(s.name) if s.name else "<unnamed>" for s in known}))
    psid = known[0].process_set_id if known else -1
    return (
        f"ranks disagree on collective of tensor {names} (process set {psid}, ranks {ranks})"
        f"{': ' + detail if detail else ''}. Every rank is blocked waiting for a collective that another rank "
        f"never issued: {'; '.join(lines)}. Collectives are matched across ranks by name (unnamed ones by their "
        "order of issue): every rank of the process set must issue each of them; none of these was run on any "
        "rank"
    )
