"""The collective engine: signature check, inline fast path, async payloads, handles.

A collective goes through three states:

1. *negotiating*: this rank's control block (signature + inline payload, ``_header``) is being
   allgathered asynchronously on the process set's control group. ``submit`` returns a handle at once.
2. *running*: the gathered blocks agreed; the payload collective was issued asynchronously on the data
   group. (Collectives whose payload fit in the control block skip this state: they finish from the
   gathered blocks alone, in one round trip.)
3. *done*: result or error available to ``synchronize``.

Entries leave the negotiating queue strictly in issue order, so payloads are issued on the data group in
the order each rank issued the collectives, whichever handle the caller waits for first.
"""

from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import torch

from phalanx.errors import CollectiveMismatchError, InvalidArgumentError
from phalanx.torch import _background, _generations, _join, _stall, _state, _trace
from phalanx.torch import _header as header
from phalanx.torch import _speculate as speculation
from phalanx.torch._collective import Collective, Entry
from phalanx.torch.process_sets import ProcessSet, _Groups, groups_of
from phalanx.transport import api as shm


@dataclass
class _Engine:
    queue: deque[Entry] = field(default_factory=deque)
    handles: dict[int, Entry] = field(default_factory=dict)
    inflight: set[str] = field(default_factory=set)
    counter: itertools.count[int] = field(default_factory=itertools.count)
    predictors: dict[tuple[int, ...], speculation.Predictor] = field(default_factory=dict)
    rounds: dict[tuple[int, ...], int] = field(default_factory=dict)  # negotiated control blocks per membership
    issued: dict[tuple[int, ...], int] = field(default_factory=dict)  # submitted control blocks per membership


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
    if name and name in ENGINE.inflight:
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
        entry.spec = _speculate(coll, groups)
        if _trace.recording():
            _trace.begin(entry.row, _trace.NEGOTIATE[coll.sig.kind], {"dtype": str(coll.sig.dtype),
                                                                      "shape": list(coll.sig.shape)})
        if entry.spec is None:
            block = header.encode(coll.sig, coll.aux(), _inline_candidate(coll), n)
        else:  # the payload is already on its way: a header-only block (every rank knows the prediction)
            block = header.encode(coll.sig, coll.aux(), None, n, inline_words=0)
        entry.gathered = torch.empty(block.numel() * n, dtype=torch.int64)
        entry.work = shm.all_gather_single(entry.gathered, block, group=groups.ctrl, async_op=True)
        ENGINE.queue.append(entry)
    if name:
        ENGINE.inflight.add(name)
    ENGINE.handles[handle] = entry
    return handle


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
    """Check the gathered blocks, then finish inline or issue the payload."""
    assert entry.groups is not None and entry.gathered is not None
    ranks = list(entry.groups.ranks)
    n = len(ranks)
    rows = entry.gathered.view(n, -1)
    _trace.end(entry.row, _trace.NEGOTIATE[entry.coll.sig.kind])
    _trace.begin(entry.row, _trace.RUN[entry.coll.sig.kind])
    headers = rows[:, : header.HEADER_WORDS].tolist()
    ENGINE.rounds[entry.groups.ranks] = ENGINE.rounds.get(entry.groups.ranks, 0) + 1
    same = all(h == headers[0] for h in headers[1:])
    if same:  # the common case: identical blocks, nothing to compare
        sigs, detail = [header.decode(headers[0])] * n, None
    else:
        sigs = [header.decode(h) for h in headers]
        if any(s.kind == "join" for s in sigs):  # some ranks have joined, others have not (see _join)
            _predictor(entry.groups.ranks).record(None)
            _join.negotiated(entry, sigs, ranks, rows)
            return
        detail = header.find_mismatch(sigs, ranks)
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
    try:
        if detail is not None:
            raise header.mismatch_error(sigs, ranks, detail, _state.topology().rank)
        aux = rows[:, header.HEADER_WORDS : header.HEADER_WORDS + n].tolist()
        nbytes = [h[header.F_NBYTES] for h in headers]
        if all(b >= 0 for b in nbytes):
            start = header.HEADER_WORDS + n
            if same:  # identical headers, so equal sizes: every rank's payload from one view
                payloads = list(rows.view(torch.uint8)[:, start * 8 : start * 8 + nbytes[0]].unbind(0))
            else:
                payloads = [rows[i, start:].view(torch.uint8)[: nbytes[i]] for i in range(n)]
            entry.coll.run_inline(payloads, sigs, aux)
            entry.state = "done"
        else:
            entry.coll.issue(entry.groups, sigs, aux)
            entry.state = "running"
    except Exception as e:
        entry.error = e
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
    if entry.state == "negotiating":
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
        ENGINE.inflight.discard(entry.name)


def run(coll: Collective, process_set: ProcessSet) -> Any:
    """Submit and wait (the synchronous form)."""
    return synchronize(submit(coll, process_set))
