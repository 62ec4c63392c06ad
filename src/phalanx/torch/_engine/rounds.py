"""One negotiated round: judge the gathered control blocks and act on them, the same way on every member.

The engine (``_engine``) sends each rank's control block and takes rounds off its queue in issue order;
this module decides what a round whose blocks have arrived does:

* every block the same and no parked entries (the fast path): finish inline from the gathered payloads,
  adopt the speculative payload when the prediction held, or issue the payload on the data group;
* blocks that differ: the positional signature check (``CollectiveMismatchError`` on every rank), a round
  with joined ranks (``_join``), or matching by name on the membership's table (``_names``).

Every decision uses only the gathered blocks and the engine's common-knowledge counters, so every member
takes the same path. The engine's state (``RUNTIME.engine``, which ``hvd.shutdown`` replaces) is passed in.
"""

from __future__ import annotations

import torch

from phalanx.errors import CollectiveMismatchError
from phalanx.torch._engine import header
from phalanx.torch._engine import join as _join
from phalanx.torch._engine import names as _names
from phalanx.torch._engine import speculate as speculation
from phalanx.torch._engine import trace as _trace
from phalanx.torch._engine.collective import Entry
from phalanx.torch._runtime import EngineState
from phalanx.torch._setup import state as _state


def predictor(engine: EngineState, ranks: tuple[int, ...]) -> speculation.Predictor:
    """The payload predictor of the membership ``ranks`` (made on first use)."""
    found = engine.predictors.get(ranks)
    if found is None:
        found = engine.predictors[ranks] = speculation.Predictor()
    return found


def negotiated(engine: EngineState, entry: Entry) -> None:
    """Check the gathered blocks, then finish inline or issue the payload (or match by name: ``_names``)."""
    assert entry.groups is not None and entry.gathered is not None
    ranks = list(entry.groups.ranks)
    n = len(ranks)
    rows = entry.gathered.view(n, -1)
    headers = rows[:, : header.HEADER_WORDS].tolist()
    engine.rounds[entry.groups.ranks] = engine.rounds.get(entry.groups.ranks, 0) + 1
    same = all(h == headers[0] for h in headers[1:])
    if same and not engine.tables and headers[0][header.F_KIND] != header.WAIT:  # the common case: nothing to compare
        sigs, detail = [header.decode(headers[0])] * n, None
    else:
        unusual = _unusual(engine, entry, rows, [header.decode(h) for h in headers], ranks)
        if unusual is None:
            return
        sigs, detail = unusual, header.find_mismatch(unusual, ranks)
    _running(entry)
    agreed = None if detail is not None else speculation.key_of(sigs[0])
    predictor(engine, entry.groups.ranks).record(agreed)
    if entry.spec is not None:
        key, buffer, work = entry.spec
        entry.spec = None
        if agreed == key and all(speculation.key_of(s) == key for s in sigs):
            entry.coll.adopt(buffer, work)  # the speculative allreduce was the payload
            entry.state = "running"
            return
        work.wait()  # a wrong guess: discard its result, carry on as usual
        speculation.release(buffer)
    _complete(entry, rows, [h[header.F_NBYTES] for h in headers], sigs, detail, same)


def _unusual(engine: EngineState, entry: Entry, rows: torch.Tensor, sigs: list[header.Signature],
             ranks: list[int]) -> list[header.Signature] | None:
    """A round whose blocks differ, or on a membership with parked entries: a join, matching by name, or the
    positional check. Returns the signatures the positional check compares, None when the round is done."""
    assert entry.groups is not None
    table = engine.tables.get(entry.groups.ranks)  # common knowledge (wait blocks only come with a table)
    if not _names.ordered(sigs):
        if table is None and _names.same_key(sigs):
            return sigs
        _by_name(engine, entry, list(rows.unbind(0)), sigs, ranks)
        return None
    joined = any(s.kind == "join" for s in sigs) and not all(s.kind == "join" for s in sigs)
    if table is not None and any(s.kind != sigs[0].kind for s in sigs):  # joins and steps match by position
        shown = _names.shown(table, sigs)  # a wait block stands for its rank's pending collective
        _fail_parked(engine, entry.groups.ranks, header.find_mismatch(shown, ranks) or "kind", shown)
        sigs = sigs if joined else shown  # (a step's own error then names the same collectives)
    if not joined:
        return sigs
    _running(entry)  # some ranks have joined, others have not (see _join)
    predictor(engine, entry.groups.ranks).record(None)
    _join.negotiated(entry, sigs, ranks, rows)
    return None


def _running(entry: Entry) -> None:
    if not entry.row:  # a wait block: not a collective of the caller's
        return
    _trace.end(entry.row, _trace.NEGOTIATE[entry.coll.sig.kind])
    _trace.begin(entry.row, _trace.RUN[entry.coll.sig.kind])


def _complete(entry: Entry, rows: torch.Tensor | list[torch.Tensor], nbytes: list[int], sigs: list[header.Signature],
              detail: str | None, same: bool) -> None:
    """Finish an agreed collective inline from every member's row (``rows``: one round's 2-D view when
    ``same``, else rows of one or several rounds), or issue its payload (an ``nbytes`` of -1)."""
    assert entry.groups is not None
    ranks = list(entry.groups.ranks)
    n = len(ranks)
    try:
        if detail is not None:
            raise header.mismatch_error(sigs, ranks, detail, _state.topology().rank)
        if same:
            aux = rows[:, header.HEADER_WORDS : header.HEADER_WORDS + n].tolist()  # type: ignore[call-overload]
        else:
            aux = [row[header.HEADER_WORDS : header.HEADER_WORDS + n].tolist() for row in rows]
        if all(b >= 0 for b in nbytes):
            start = header.HEADER_WORDS + n
            if same:  # identical headers, so equal sizes: every rank's payload from one view
                payloads = list(rows.view(torch.uint8)[:, start * 8 : start * 8 + nbytes[0]].unbind(0))  # type: ignore[union-attr]
            else:
                payloads = [rows[i][start:].view(torch.uint8)[: nbytes[i]] for i in range(n)]
            entry.coll.run_inline(payloads, sigs, aux)
            entry.state = "done"
        else:
            entry.coll.issue(entry.groups, sigs, aux)
            entry.state = "running"
    except Exception as e:
        entry.error = e
        entry.state = "done"


def _by_name(engine: EngineState, entry: Entry, rows: list[torch.Tensor], sigs: list[header.Signature],
             ranks: list[int]) -> None:
    """A round whose blocks name different collectives, or on a membership with parked ones (``_names``)."""
    assert entry.groups is not None
    membership = entry.groups.ranks
    table = engine.tables.get(membership)
    if table is None:
        table = engine.tables[membership] = _names.Table(len(ranks))
    predictor(engine, membership).record(None)
    if entry.spec is not None:  # a speculative payload stands only for a round that agreed at once
        _key, buffer, work = entry.spec
        entry.spec = None
        work.wait()
        speculation.release(buffer)
    out = _names.add_round(table, entry, ranks.index(_state.topology().rank), rows, sigs, ranks)
    for ready, parts, psigs in out.ready:
        _running(ready)
        nbytes = [int(row[header.F_NBYTES]) for row in parts]
        _complete(ready, parts, nbytes, psigs, header.find_mismatch(psigs, ranks), False)
    for failed in out.failed:
        _running(failed)
        failed.error = CollectiveMismatchError(out.error)
        failed.state = "done"
    if not table.pending:
        del engine.tables[membership]


def _fail_parked(engine: EngineState, membership: tuple[int, ...], detail: str, sigs: list[header.Signature]) -> None:
    """Fail every parked entry of ``membership`` (a join or a step met other blocks: the ranks are out of
    step) with the round's mismatch error, and forget the table, on every member alike."""
    table = engine.tables.pop(membership)
    for entry in table.mine.values():
        _running(entry)
        entry.error = header.mismatch_error(sigs, list(membership), detail, _state.topology().rank)
        entry.state = "done"
