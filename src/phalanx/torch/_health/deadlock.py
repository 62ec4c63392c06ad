"""Deadlock analysis for the stall inspector (``_stall``): from every blocked rank's published record, the
largest set of ranks that wait for each other, and the error that names them.

Pure functions of the records: no store, no collective, no clock; every blocked rank computes the same
answer from the same records.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

Ranks = tuple[int, ...]


@dataclass
class Record:
    """What one rank published: its wait (None: running) and its per-membership counters.

    Attributes:
        rank: the global rank.
        version: changes with every publication.
        wait: ``{"ranks", "seq", "phase", "kind", "name", "psid"}`` or None.
        issued: control blocks submitted per membership.
        rounds: control blocks negotiated per membership (their payloads are issued).
    """

    rank: int
    version: int = 0
    wait: dict[str, Any] | None = None
    issued: dict[Ranks, int] = field(default_factory=dict)
    rounds: dict[Ranks, int] = field(default_factory=dict)

    def dumps(self) -> str:
        """The record as JSON."""
        return json.dumps({"rank": self.rank, "v": self.version, "wait": self.wait,
                           "issued": [[list(k), v] for k, v in self.issued.items()],
                           "rounds": [[list(k), v] for k, v in self.rounds.items()]})

    @classmethod
    def loads(cls, text: str) -> Record:
        """Parse :meth:`dumps` output."""
        d = json.loads(text)
        wait = d["wait"]
        if wait is not None:
            wait["ranks"] = tuple(wait["ranks"])
        return cls(rank=d["rank"], version=d["v"], wait=wait,
                   issued={tuple(k): v for k, v in d["issued"]},
                   rounds={tuple(k): v for k, v in d["rounds"]})


def awaited(rec: Record, records: dict[int, Record]) -> list[int]:
    """The *blocked* peers ``rec``'s wait needs and that have not reached its collective yet.

    A control block waits for peers that have not issued the collective; a payload for peers that have not
    negotiated it (their payload is issued when they do). Running peers are not listed (they may arrive).
    """
    w = rec.wait
    if w is None:
        return []
    out = []
    for p in w["ranks"]:
        peer = records.get(p)
        if p == rec.rank or peer is None or peer.wait is None:
            continue
        count = (peer.issued if w["phase"] == "control" else peer.rounds).get(w["ranks"], 0)
        if count < w["seq"]:
            out.append(p)
    return out


def deadlocked(records: dict[int, Record]) -> set[int]:
    """The largest set of blocked ranks in which each waits for at least one rank of the set."""
    needs = {r: set(awaited(rec, records)) for r, rec in records.items() if rec.wait is not None}
    stuck = set(needs)
    changed = True
    while changed:
        free = {r for r in stuck if not needs[r] & stuck}
        stuck -= free
        changed = bool(free)
    return stuck


def describe(stuck: set[int], records: dict[int, Record]) -> str:
    """The error text: every deadlocked rank's collective and whom it waits for."""
    lines = []
    for r in sorted(stuck):
        rec = records[r]
        w = rec.wait
        assert w is not None
        ranks = w["ranks"]
        peers = sorted(set(awaited(rec, records)) & stuck)
        counts = ", ".join(f"rank {p} issued {records[p].issued.get(ranks, 0)}" for p in peers)
        name = w["name"] or "<unnamed>"
        lines.append(
            f"rank {r} waits in {w['kind']} of tensor {name!r} on process set {w['psid']} (ranks "
            f"{list(ranks)}; its collective #{w['seq']} there) for {counts} there"
        )
    joined = [r for r in sorted(stuck) if (records[r].wait or {}).get("kind") == "join"]
    hint = (
        f" Rank(s) {joined} called hvd.join(), which serves only the global process set (as in Horovod): "
        "while a rank is joined, the others may not run collectives or DistributedOptimizer steps on other "
        "process sets that include it."
        if joined
        else ""
    )
    return (
        "ranks are blocked on collectives of different process sets (a deadlock): " + "; ".join(lines) + ". "
        "Every rank must issue the collectives of every process set it belongs to in the same order; the "
        "collectives were abandoned and these process sets cannot be used any more (shut down and restart)." + hint
    )


def operation(wait: dict[str, Any]) -> str:
    """The user's collective a wait serves: ``"allreduce 'loss' (process set 0, ranks [0, 1])"``."""
    return f"{wait['kind']} {wait['name'] or '<unnamed>'!r} (process set {wait['psid']}, ranks {list(wait['ranks'])})"


def missing(me: int, wait: dict[str, Any], records: dict[int, Record]) -> list[tuple[int, str]]:
    """The ranks of ``wait``'s set that have not reached it, each with what it is doing instead (from the
    records the blocked ranks published; a rank without one runs outside any phalanx collective)."""
    ranks = wait["ranks"]
    out = []
    for p in ranks:
        if p == me:
            continue
        peer = records.get(p)
        if peer is None or peer.wait is None:
            out.append((p, "is not in any phalanx collective (busy elsewhere, it skipped this one, or it has "
                           "ended)"))
            continue
        w = peer.wait
        count = (peer.issued if wait["phase"] == "control" else peer.rounds).get(ranks, 0)
        if count >= wait["seq"]:
            continue  # it has reached this collective: it waits for the others too
        out.append((p, f"waits in {operation(w)}, its collective #{w['seq']} there"))
    return out


def stalled_text(me: int, wait: dict[str, Any], records: dict[int, Record]) -> str:
    """One line: the collective ``me`` waits in and the ranks missing from it."""
    gone = missing(me, wait, records)
    if not gone:
        return f"{operation(wait)}: every rank has reached it (a slow transfer)"
    listed = "; ".join(f"rank {r} {why}" for r, why in gone)
    return f"{operation(wait)} lacks rank(s) {[r for r, _ in gone]}: {listed}"
