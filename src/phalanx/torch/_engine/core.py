"""The collective engine: handles, the queue of control blocks in issue order, waiting for results.

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
rank), whichever handle the caller waits for first. What a round does once its blocks have arrived (the
signature check, the inline finish, the payload, joins and matching by name) is ``_rounds``'.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from phalanx.errors import CollectiveMismatchError, InvalidArgumentError
from phalanx.job import stats
from phalanx.torch._engine import background as _background
from phalanx.torch._engine import header
from phalanx.torch._engine import names as _names
from phalanx.torch._engine import rounds as _rounds
from phalanx.torch._engine import speculate as speculation
from phalanx.torch._engine import trace as _trace
from phalanx.torch._engine.collective import Collective, Entry
from phalanx.torch._health import stall as _stall
from phalanx.torch._runtime import RUNTIME
from phalanx.torch._setup import state as _state
from phalanx.torch.process_sets import ProcessSet, _Groups, groups_of
from phalanx.transport import api as shm


@dataclass(frozen=True)
class Parked:
    """A background job's result when its collective was parked: the engine handle to wait for."""

    handle: int


def reset() -> None:
    """Fail the queued ``*_async`` jobs and stop the stall inspector (``hvd.shutdown``; ``RUNTIME.reset()``
    then forgets the pending collectives)."""
    _background.abandon("hvd.shutdown() was called before this *_async collective ran")
    _stall.stop()


def rounds(ranks: tuple[int, ...]) -> int:
    """Control blocks negotiated so far on this membership by the current engine (common knowledge)."""
    return RUNTIME.engine.rounds.get(ranks, 0)


def start_inspector() -> None:
    """Start the stall inspector for a new ``hvd.init()`` (before its first collective)."""
    _stall.start(lambda: (RUNTIME.engine.issued, RUNTIME.engine.rounds))


def _inline_candidate(coll: Collective) -> torch.Tensor | None:
    if coll.sig.device != 0:
        return None
    if coll.sig.kind == "barrier":
        return torch.empty(0, dtype=torch.uint8)
    raw = coll.payload_bytes()
    return raw if raw.numel() <= header.INLINE_BYTES else None


#: Unnamed collectives that a training loop issues once per step: one timeline row each, not one per call.
_STEP_ROWS = {"optimizer step": "optimizer.step", "barrier": "barrier", "join": "join"}


def timeline_row(kind: str, name: str | None, handle: int) -> str:
    """The collective's timeline row: Horovod's ``op.name``; unnamed, ``op.noname.N`` (Horovod's), except
    the per-step control collectives, which keep one row (:data:`_STEP_ROWS`) so a trace of 230 steps does
    not have 230 rows."""
    if name:
        return f"{kind}.{name}"
    return _STEP_ROWS.get(kind) or f"{kind}.noname.{handle}"


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
    handle = next(RUNTIME.engine.counter)
    entry.row = timeline_row(coll.sig.kind, name, handle)
    n = len(groups.ranks)
    if n == 1:
        _finish_single(entry)
    else:
        if RUNTIME.job.superseded is not None:
            raise CollectiveMismatchError(RUNTIME.job.superseded)
        if RUNTIME.inspector.broken and (error := _stall.broken(groups.ranks)) is not None:
            raise error
        if RUNTIME.engine.queue:
            advance()  # predictions need every earlier control block: common knowledge on every rank
        entry.seq = RUNTIME.engine.issued[groups.ranks] = RUNTIME.engine.issued.get(groups.ranks, 0) + 1
        RUNTIME.inspector.entry = entry
        entry.spec = None if groups.ranks in RUNTIME.engine.tables else _speculate(coll, groups)
        if _trace.recording():
            _trace.begin(entry.row, _trace.NEGOTIATE[coll.sig.kind], {"dtype": str(coll.sig.dtype),
                                                                      "shape": list(coll.sig.shape)})
        if entry.spec is None:
            block = header.encode(coll.sig, coll.aux(), _inline_candidate(coll), n)
        else:  # the payload is already on its way: a header-only block (every rank knows the prediction)
            block = header.encode(coll.sig, coll.aux(), None, n, inline_words=0)
        _send(entry, groups, block)
    if name:
        RUNTIME.engine.inflight[name] = entry
    RUNTIME.engine.handles[handle] = entry
    return handle


def busy(name: str) -> bool:
    """Whether a collective named ``name`` is in flight: issued and not finished (Horovod's rule; a finished
    one frees its name even before ``synchronize``)."""
    entry = RUNTIME.engine.inflight.get(name)
    if entry is None:
        return False
    if entry.state == "done" or (entry.state == "running" and entry.coll.is_done()):
        if RUNTIME.engine.inflight.get(name) is entry:  # the caller's thread and the background thread may both free it
            RUNTIME.engine.inflight.pop(name, None)
        return False
    return True


def _send(entry: Entry, groups: _Groups, block: torch.Tensor) -> None:
    """Start the allgather of this rank's control block and queue the entry."""
    entry.gathered = torch.empty(block.numel() * len(groups.ranks), dtype=torch.int64)
    entry.work = shm.all_gather_single(entry.gathered, block, group=groups.ctrl, async_op=True)
    RUNTIME.engine.queue.append(entry)


def _send_wait(groups: _Groups, awaited: Entry, blocked: bool) -> None:
    """Send a ``wait`` block for ``awaited`` (parked): the round lets the peers' blocks fill its table."""
    coll = _names.Wait(awaited.coll.sig, blocked)
    entry = Entry(coll=coll, groups=groups)
    entry.seq = RUNTIME.engine.issued[groups.ranks] = RUNTIME.engine.issued.get(groups.ranks, 0) + 1
    _send(entry, groups, header.encode(coll.sig, [], coll.payload_bytes(), len(groups.ranks)))


def _await_parked(entry: Entry) -> None:
    """Take part in rounds on ``entry``'s membership until it is no longer parked."""
    assert entry.groups is not None
    while True:
        advance()  # every earlier round first: whether a table exists must be common knowledge
        if entry.state != "parked":
            return
        _send_wait(entry.groups, entry, blocked=True)


def step_parked(handle: int, blocked: bool) -> bool:
    """One round for the parked collective of ``handle``, on the background thread, for a caller that is one
    of several threads issuing collectives (``async_ops.synchronize_shared``): True once it is no longer
    parked. ``blocked`` says whether this rank can still issue anything (the deadlock rule of ``_names``)."""
    entry = _lookup(handle)
    advance()
    if entry.state == "parked":
        assert entry.groups is not None
        _send_wait(entry.groups, entry, blocked)
        advance()
    return entry.state != "parked"


def _speculate(coll: Collective, groups: _Groups) -> tuple[speculation.Key, torch.Tensor, Any] | None:
    key = _rounds.predictor(RUNTIME.engine, groups.ranks).predict()
    if key is None:
        return None
    mine = coll.speculative_buffer(key) if speculation.key_of(coll.sig) == key else None
    buffer = mine if mine is not None else speculation.garbage(key)
    return key, buffer, speculation.launch(buffer, key, groups.data)


def _finish_single(entry: Entry) -> None:
    coll = entry.coll
    try:
        coll.run_inline([coll.payload_bytes()], [coll.sig], [coll.aux()])
    except Exception as e:
        entry.error = e
    entry.state = "done"


def advance(until: Entry | None = None, block: bool = True) -> None:
    """Move negotiated collectives on, in issue order.

    Args:
        until: stop after this entry (None: drain the whole queue).
        block: wait for control blocks that have not arrived yet; when False stop at the first one.
    """
    queue = RUNTIME.engine.queue
    while queue:
        entry = queue[0]
        if RUNTIME.inspector.broken and _abandoned(entry):
            queue.popleft()
            continue
        if not block and not entry.work.is_completed():
            return
        RUNTIME.inspector.entry = entry
        _stall.wait(entry.work)
        queue.popleft()
        _rounds.negotiated(RUNTIME.engine, entry)
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
    if RUNTIME.engine.queue:
        advance()


def _lookup(handle: int) -> Entry:
    entry = RUNTIME.engine.handles.get(handle)
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
    if entry.state == "parked" and not RUNTIME.engine.queue:
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
    waiting = stats.begin(entry.coll.sig.kind)
    try:
        if entry.state == "negotiating":
            advance(until=entry)
        if entry.state == "parked":
            _await_parked(entry)
        if entry.error is not None:
            raise entry.error
        if entry.state == "running" and entry.coll.sig.device == 0:
            RUNTIME.inspector.entry = entry
            for work in entry.coll.pending():
                _stall.wait(work)
        return entry.coll.finish()
    finally:
        if waiting:
            stats.end(entry.coll.sig.kind, waiting, _payload_bytes(entry.coll.sig))
        if entry.gathered is not None:
            _trace.end(entry.row, _trace.RUN[entry.coll.sig.kind])
        del RUNTIME.engine.handles[handle]
        if RUNTIME.engine.inflight.get(entry.name) is entry:
            RUNTIME.engine.inflight.pop(entry.name, None)


def _payload_bytes(sig: header.Signature) -> int:
    """Bytes of the collective's (first) tensor, for the stats records."""
    if isinstance(sig.dtype, str):  # a peer's dtype this torch lacks (never this rank's own)
        return 0
    count = 1
    for n in sig.shape:
        count *= n
    return count * sig.dtype.itemsize


def run(coll: Collective, process_set: ProcessSet) -> Any:
    """Submit and wait (the synchronous form)."""
    return synchronize(submit(coll, process_set))


def run_job(coll: Collective, process_set: ProcessSet) -> Any:
    """Run a collective for the background thread: to its result, or until it is parked (then ``Parked``,
    so that the thread, and the caller's later collectives, go on while it waits for the peers)."""
    handle = submit(coll, process_set)
    entry = RUNTIME.engine.handles[handle]
    if entry.state == "negotiating":
        advance(until=entry)
    if entry.state == "parked":
        return Parked(handle)
    return synchronize(handle)
