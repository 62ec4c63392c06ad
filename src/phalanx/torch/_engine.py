"""The collective engine: signature check, inline fast path, async payloads, handles.

A collective goes through three states:

1. *negotiating*: this rank's control block (signature + inline payload, ``_header``) is being
   allgathered asynchronously on the process set's control group. ``submit`` returns a handle at once.
   (*parked*: the round's blocks named different collectives and this one waits, in ``_names``' table,
   until every member has issued a collective of its name.)
2. *running*: the gathered blocks agreed; the payload collective was issued asynchronously on the data
   group. (Collectives whose payload fit in the control block skip this state: they finish from the
   gathered blocks alone, in one round trip.)
3. *done*: result or error available to ``synchronize``.

Entries leave the negotiating queue strictly in issue order, so payloads are issued on the data group in
the order each rank issued the collectives (or, for parked ones, in the order they became ready on every
rank), whichever handle the caller waits for first.
"""

from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import torch

from phalanx.errors import CollectiveMismatchError, InvalidArgumentError
from phalanx.torch import _background, _generations, _join, _names, _stall, _state, _trace
from phalanx.torch import _header as header
from phalanx.torch import _speculate as speculation
from phalanx.torch._collective import Collective, Entry
from phalanx.torch.process_sets import ProcessSet, _Groups, groups_of
from phalanx.transport import api as shm


@dataclass
class _Engine:
    queue: deque[Entry] = field(default_factory=deque)
    handles: dict[int, Entry] = field(default_factory=dict)
    inflight: dict[str, Entry] = field(default_factory=dict)  # named collectives not finished yet
    counter: itertools.count[int] = field(default_factory=itertools.count)
    predictors: dict[tuple[int, ...], speculation.Predictor] = field(default_factory=dict)
    rounds: dict[tuple[int, ...], int] = field(default_factory=dict)  # negotiated control blocks per membership
    issued: dict[tuple[int, ...], int] = field(default_factory=dict)  # submitted control blocks per membership
    tables: dict[tuple[int, ...], _names.Table] = field(default_factory=dict)  # memberships with parked entries


@dataclass(frozen=True)
class Parked:
    """A background job's result when its collective was parked: the engine handle to wait for."""

    handle: int


ENGINE = _Engine()


def reset() -> None:
    """Forget every pending collective (``hvd.shutdown``)."""
    global ENGINE
    _background.abandon("hvd.shutdown() was called before this *_async collective ran")
    ENGINE = _Engine()
    _stall.stop()


def rounds(ranks: tuple[int, ...]) -> int:
    """Control blocks negotiated so far on this membership by the current engine (common knowledge)."""
    return ENGINE.rounds.get(ranks, 0)


def start_inspector() -> None:
    """Start the stall inspector for a new ``hvd.init()`` (before its first collective)."""
    _stall.INSPECTOR.start(lambda: (ENGINE.issued, ENGINE.rounds))


def _inline_candidate(coll: Collective) -> torch.Tensor | None:
    if coll.sig.device != 0:
        return None
    if coll.sig.kind == "barrier":
        return torch.empty(0, dtype=torch.uint8)
    raw = coll.payload_bytes()
    return raw if raw.numel() <= header.INLINE_BYTES else None


def submit(coll: Collective, process_set: ProcessSet) -> int:
    """Start a collective; return its handle.

    Raises:
        NotInitializedError: before ``hvd.init()``.
        ValueError: another in-flight collective on this rank has the same name, or this rank is not a
            member of the process set.
    """
    _background.drain()  # queued *_async collectives first: the engine keeps this rank's order of issue
    groups = groups_of(process_set)
    name = coll.sig.name
    if name and busy(name):
        raise InvalidArgumentError(
            f"a collective named {name!r} is already in flight on rank {_state.topology().rank}; "
            "synchronize() it first or give the new one a different name="
        )
    entry = Entry(coll=coll, groups=groups, name=name)
    handle = next(ENGINE.counter)
    entry.row = f"{coll.sig.kind}.{name}" if name else f"{coll.sig.kind}.noname.{handle}"  # Horovod's op names
    n = len(groups.ranks)
    if n == 1:
        _finish_single(entry)
    else:
        if _generations.JOB.superseded is not None:
            raise CollectiveMismatchError(_generations.JOB.superseded)
        if _stall.INSPECTOR.broken and (error := _stall.broken(groups.ranks)) is not None:
            raise error
        if ENGINE.queue:
            advance()  # predictions need every earlier control block: common knowledge on every rank
        entry.seq = ENGINE.issued[groups.ranks] = ENGINE.issued.get(groups.ranks, 0) + 1
        _stall.WATCH.entry = entry
        entry.spec = None if groups.ranks in ENGINE.tables else _speculate(coll, groups)
        if _trace.recording():
            _trace.begin(entry.row, _trace.NEGOTIATE[coll.sig.kind], {"dtype": str(coll.sig.dtype),
                                                                      "shape": list(coll.sig.shape)})
        if entry.spec is None:
            block = header.encode(coll.sig, coll.aux(), _inline_candidate(coll), n)
        else:  # the payload is already on its way: a header-only block (every rank knows the prediction)
            block = header.encode(coll.sig, coll.aux(), None, n, inline_words=0)
        _send(entry, groups, block)
    if name:
        ENGINE.inflight[name] = entry
    ENGINE.handles[handle] = entry
    return handle


def busy(name: str) -> bool:
    """Whether a collective named ``name`` is in flight: issued and not finished (Horovod's rule; a finished
    one frees its name even before ``synchronize``)."""
    entry = ENGINE.inflight.get(name)
    if entry is None:
        return False
    if entry.state == "done" or (entry.state == "running" and entry.coll.is_done()):
        if ENGINE.inflight.get(name) is entry:  # the caller's thread and the background thread may both free it
            ENGINE.inflight.pop(name, None)
        return False
    return True


def _send(entry: Entry, groups: _Groups, block: torch.Tensor) -> None:
    """Start the allgather of this rank's control block and queue the entry."""
    entry.gathered = torch.empty(block.numel() * len(groups.ranks), dtype=torch.int64)
    entry.work = shm.all_gather_single(entry.gathered, block, group=groups.ctrl, async_op=True)
    ENGINE.queue.append(entry)


def _send_wait(groups: _Groups, awaited: Entry, blocked: bool) -> None:
    """Send a ``wait`` block for ``awaited`` (parked): the round lets the peers' blocks fill its table."""
    coll = _names.Wait(awaited.coll.sig, blocked)
    entry = Entry(coll=coll, groups=groups)
    entry.seq = ENGINE.issued[groups.ranks] = ENGINE.issued.get(groups.ranks, 0) + 1
    _send(entry, groups, header.encode(coll.sig, [], coll.payload_bytes(), len(groups.ranks)))


def _await_parked(entry: Entry) -> None:
    """Take part in rounds on ``entry``'s membership until it is no longer parked."""
    assert entry.groups is not None
    while True:
        advance()  # every earlier round first: whether a table exists must be common knowledge
        if entry.state != "parked":
            return
        _send_wait(entry.groups, entry, blocked=True)


def _speculate(coll: Collective, groups: _Groups) -> tuple[speculation.Key, torch.Tensor, Any] | None:
    key = _predictor(groups.ranks).predict()
    if key is None:
        return None
    mine = coll.speculative_buffer(key) if speculation.key_of(coll.sig) == key else None
    buffer = mine if mine is not None else speculation.garbage(key)
    return key, buffer, speculation.launch(buffer, key, groups.data)


def _predictor(ranks: tuple[int, ...]) -> speculation.Predictor:
    predictor = ENGINE.predictors.get(ranks)
    if predictor is None:
        predictor = ENGINE.predictors[ranks] = speculation.Predictor()
    return predictor


def _finish_single(entry: Entry) -> None:
    coll = entry.coll
    try:
        coll.run_inline([coll.payload_bytes()], [coll.sig], [coll.aux()])
    except Exception as e:
        entry.error = e
    entry.state = "done"


def _negotiated(entry: Entry) -> None:
    """Check the gathered blocks, then finish inline or issue the payload (or match by name: ``_names``)."""
    assert entry.groups is not None and entry.gathered is not None
    ranks = list(entry.groups.ranks)
    n = len(ranks)
    rows = entry.gathered.view(n, -1)
    headers = rows[:, : header.HEADER_WORDS].tolist()
    ENGINE.rounds[entry.groups.ranks] = ENGINE.rounds.get(entry.groups.ranks, 0) + 1
    same = all(h == headers[0] for h in headers[1:])
    if same and not ENGINE.tables and headers[0][header.F_KIND] != header.WAIT:  # the common case: nothing to compare
        sigs, detail = [header.decode(headers[0])] * n, None
    else:
        unusual = _unusual(entry, rows, [header.decode(h) for h in headers], ranks)
        if unusual is None:
            return
        sigs, detail = unusual, header.find_mismatch(unusual, ranks)
    _running(entry)
    agreed = None if detail is not None else speculation.key_of(sigs[0])
    _predictor(entry.groups.ranks).record(agreed)
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


def _unusual(entry: Entry, rows: torch.Tensor, sigs: list[header.Signature],
             ranks: list[int]) -> list[header.Signature] | None:
    """A round whose blocks differ, or on a membership with parked entries: a join, matching by name, or the
    positional check. Returns the signatures the positional check compares, None when the round is done."""
    assert entry.groups is not None
    table = ENGINE.tables.get(entry.groups.ranks)  # common knowledge (wait blocks only come with a table)
    if not _names.ordered(sigs):
        if table is None and _names.same_key(sigs):
            return sigs
        _by_name(entry, list(rows.unbind(0)), sigs, ranks)
        return None
    joined = any(s.kind == "join" for s in sigs) and not all(s.kind == "join" for s in sigs)
    if table is not None and any(s.kind != sigs[0].kind for s in sigs):  # joins and steps match by position
        shown = _names.shown(table, sigs)  # a wait block stands for its rank's pending collective
        _fail_parked(entry.groups.ranks, header.find_mismatch(shown, ranks) or "kind", shown)
        sigs = sigs if joined else shown  # (a step's own error then names the same collectives)
    if not joined:
        return sigs
    _running(entry)  # some ranks have joined, others have not (see _join)
    _predictor(entry.groups.ranks).record(None)
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


def _by_name(entry: Entry, rows: list[torch.Tensor], sigs: list[header.Signature], ranks: list[int]) -> None:
    """A round whose blocks name different collectives, or on a membership with parked ones (``_names``)."""
    assert entry.groups is not None
    membership = entry.groups.ranks
    table = ENGINE.tables.get(membership)
    if table is None:
        table = ENGINE.tables[membership] = _names.Table(len(ranks))
    _predictor(membership).record(None)
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
        del ENGINE.tables[membership]


def _fail_parked(membership: tuple[int, ...], detail: str, sigs: list[header.Signature]) -> None:
    """Fail every parked entry of ``membership`` (a join or a step met other blocks: the ranks are out of
    step) with the round's mismatch error, and forget the table, on every member alike."""
    table = ENGINE.tables.pop(membership)
    for entry in table.mine.values():
        _running(entry)
        entry.error = header.mismatch_error(sigs, list(membership), detail, _state.topology().rank)
        entry.state = "done"


def advance(until: Entry | None = None, block: bool = True) -> None:
    """Move negotiated collectives on, in issue order.

    Args:
        until: stop after this entry (None: drain the whole queue).
        block: wait for control blocks that have not arrived yet; when False stop at the first one.
    """
    queue = ENGINE.queue
    while queue:
        entry = queue[0]
        if _stall.INSPECTOR.broken and _abandoned(entry):
            queue.popleft()
            continue
        if not block and not entry.work.is_completed():
            return
        _stall.WATCH.entry = entry
        _stall.wait(entry.work)
        queue.popleft()
        _negotiated(entry)
        if entry is until:
            return


def _abandoned(entry: Entry) -> bool:
    """Fail a queued entry of a membership abandoned in a deadlock (``_stall``); True when it was."""
    assert entry.groups is not None
    entry.error = _stall.broken(entry.groups.ranks)
    if entry.error is None:
        return False
    entry.state = "done"
    return True


def flush() -> None:
    """Issue every pending payload (callers that use the data group directly call this first)."""
    _background.drain()
    if ENGINE.queue:
        advance()


def _lookup(handle: int) -> Entry:
    entry = ENGINE.handles.get(handle)
    if entry is None:
        raise InvalidArgumentError(f"handle {handle!r} is unknown or was already synchronized")
    return entry


def poll(handle: int) -> bool:
    """Whether the collective of ``handle`` has finished (never blocks).

    Raises:
        ValueError: the handle is unknown.
    """
    _background.drain()
    entry = _lookup(handle)
    if entry.state == "parked" and not ENGINE.queue:
        assert entry.groups is not None
        _send_wait(entry.groups, entry, blocked=False)  # a round in which the peers' blocks may complete it
    if entry.state in ("negotiating", "parked"):
        advance(block=False)
    if entry.state == "running":
        return entry.coll.is_done()
    return entry.state == "done"


def synchronize(handle: int) -> Any:
    """Wait for the collective of ``handle`` and return its result.

    Raises:
        CollectiveMismatchError: the ranks disagreed about the collective (raised on every rank).
        ValueError: the handle is unknown.
    """
    _background.drain()
    entry = _lookup(handle)
    try:
        if entry.state == "negotiating":
            advance(until=entry)
        if entry.state == "parked":
            _await_parked(entry)
        if entry.error is not None:
            raise entry.error
        if entry.state == "running" and entry.coll.sig.device == 0:
            _stall.WATCH.entry = entry
            for work in entry.coll.pending():
                _stall.wait(work)
        return entry.coll.finish()
    finally:
        if entry.gathered is not None:
            _trace.end(entry.row, _trace.RUN[entry.coll.sig.kind])
        del ENGINE.handles[handle]
        if ENGINE.inflight.get(entry.name) is entry:
            ENGINE.inflight.pop(entry.name, None)


def run(coll: Collective, process_set: ProcessSet) -> Any:
    """Submit and wait (the synchronous form)."""
    return synchronize(submit(coll, process_set))


def run_job(coll: Collective, process_set: ProcessSet) -> Any:
    """Run a collective for the background thread: to its result, or until it is parked (then ``Parked``,
    so that the thread, and the caller's later collectives, go on while it waits for the peers)."""
    handle = submit(coll, process_set)
    entry = ENGINE.handles[handle]
    if entry.state == "negotiating":
        advance(until=entry)
    if entry.state == "parked":
        return Parked(handle)
    return synchronize(handle)
