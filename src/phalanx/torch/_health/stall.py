"""The stall inspector: ranks blocked on collectives that can never complete raise instead of hanging.

The signature check (``_header``) compares what the ranks of *one* process set issue. Ranks that issue
collectives on *different* registered sets (rank 0 on ``[0, 1]`` while rank 1 waits on ``[1, 2]`` or on
the global set) exchange their control blocks on different groups, so no block ever meets the other, and
each rank waits for a peer that is itself waiting. Nothing of this runs on the fast path: a wait that has
not completed after ``PHALANX_STALL_CHECK_S`` seconds makes the rank publish, in the job's store (the
``TCPStore`` of the default process group), what it waits on — the membership and the collective's index
on it, its kind and tensor name — together with how many collectives it has issued and negotiated on each
membership. Every blocked rank then reads every rank's record (one ``multi_get``) once per ``POLL_S``,
backing off to ``POLL_MAX_S`` while nothing looks deadlocked (a long legitimate wait of many ranks must
not flood the store), and computes the
deadlocked ranks: the largest set of blocked ranks each of which waits for at least one rank of the set
(a wait needs *every* member, so none of them can be the first to move). A rank that is merely slow (it
has not published, or waits for a rank that runs) keeps everyone waiting, up to the transport's timeout.

A deadlock is confirmed when two polls see the same records (each record has a version that changes with
every new wait), then the confirming rank writes a verdict for every deadlocked rank, and every one of
them raises the same ``CollectiveMismatchError``. The abandoned collectives leave their process sets out
of step: the engine refuses further collectives on those memberships (``broken``). The analysis of the
records (who is deadlocked, the error's text) is ``_deadlock``'s; this module publishes, polls and decides.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from phalanx.env import names as env_names
from phalanx.env import settings
from phalanx.errors import CollectiveMismatchError, HorovodInternalError
from phalanx.torch._health import generations as _generations
from phalanx.torch._health import hang as _hang
from phalanx.torch._health.deadlock import Ranks, Record, deadlocked, describe, operation, stalled_text
from phalanx.torch._runtime import RUNTIME, Inspector
from phalanx.transport import api as transport

_log = logging.getLogger(__name__)
DEFAULT_CHECK_S = 5.0
DEFAULT_WARN_S = 60.0  # Horovod's stall warning time
POLL_S = 1.0  # between two reads of the records once a rank has published (at most the check interval)
POLL_MAX_S = 10.0  # the back-off's limit
PREFIX = "phalanx.stall/"
ACK_S = 3 * POLL_S  # how long the rank that confirms a deadlock waits for the others to read the verdict


def start(counters: Callable[[], tuple[dict[Ranks, int], dict[Ranks, int]]]) -> None:
    """Reset for a new ``hvd.init()`` (before its first collective: every rank clears its record)."""
    ins = RUNTIME.inspector = Inspector()
    ins.counters = counters
    ins.check_s = check_interval()
    ins.shutdown_s = shutdown_after()
    ins.warn_s = warn_after()
    if 0 < ins.shutdown_s < ins.warn_s:  # Horovod's rule
        _log.warning("HOROVOD_STALL_SHUTDOWN_TIME_SECONDS (%g) is less than HOROVOD_STALL_CHECK_TIME_SECONDS "
                     "(%g): stalled collectives will not be shut down", ins.shutdown_s, ins.warn_s)
        ins.shutdown_s = 0.0
    if ins.check_s <= 0 or not dist.is_initialized() or dist.get_world_size() == 1:
        ins.check_s = 0.0
        return
    ins.check_td = timedelta(seconds=ins.check_s)
    ins.poll_td = timedelta(seconds=min(POLL_S, ins.check_s))
    transport.set_wait_hooks(transport.WaitHooks(on_stall, resumed, verdict, pending_operation))
    ins.store = dist.PrefixStore(PREFIX, dist.distributed_c10d._get_default_store())
    ins.rank, ins.size = dist.get_rank(), dist.get_world_size()
    ins.store.set(f"rec/{ins.rank}", "")
    ins.store.set(f"verdict/{ins.rank}", "")
    _hang.start(ins.store, ins.rank, ins.size, published_operation)


def stalled(wait: dict[str, Any]) -> CollectiveMismatchError | None:
    """Called while a wait has lasted at least ``check_s``: publish once, then poll every ``POLL_S``.

    Returns:
        The error to raise when this rank is part of a confirmed deadlock, else None.
    """
    ins = RUNTIME.inspector
    why = _generations.moved_on(tuple(wait["ranks"]))
    if why is not None:  # a peer called shutdown() and init() again: nothing can serve this wait
        resumed()
        return CollectiveMismatchError(why)
    now = time.monotonic()
    if ins.mine is None:
        issued, rounds = ins.counters()
        ins.version += 1
        ins.mine = Record(ins.rank, ins.version, wait, dict(issued), dict(rounds))
        ins.store.set(f"rec/{ins.rank}", ins.mine.dumps())
        ins.candidate, ins.next_poll, ins.interval = None, now, min(POLL_S, ins.check_s)
    if now < ins.next_poll:
        if now < ins.next_verdict:
            return None
        ins.next_verdict = now + POLL_S
        return verdict()
    ins.next_verdict = now + POLL_S
    error = _poll(ins.mine)
    # a candidate deadlock is confirmed at the next poll; otherwise back off
    ins.interval = ins.interval if ins.candidate is not None else min(ins.interval * 1.5, POLL_MAX_S)
    ins.next_poll = now + ins.interval
    return error


def verdict() -> CollectiveMismatchError | None:
    """The error of a deadlock another rank confirmed for this rank's current record, else None (also
    consulted when a transport fails: a deadlocked peer that raised and exited must not be reported as a
    dead peer)."""
    ins = RUNTIME.inspector
    mine = ins.mine
    if mine is None:
        return None
    try:
        text = ins.store.get(f"verdict/{ins.rank}").decode()
    except (RuntimeError, OSError):
        return None
    d = json.loads(text) if text else None
    if d is None or d["v"] != mine.version:
        return None
    return _fail(d["msg"], d["sets"])


def _poll(mine: Record) -> CollectiveMismatchError | None:
    ins = RUNTIME.inspector
    error = verdict()
    if error is not None:
        return error
    records = _records(mine)
    stuck = deadlocked(records)
    if ins.rank not in stuck:
        ins.candidate = None
        return None
    seen = {r: records[r].version for r in stuck}
    if seen != ins.candidate:
        ins.candidate = seen  # confirmed when the next poll sees the same records
        return None
    msg = describe(stuck, records)
    sets = sorted({tuple(w["ranks"]) for r in stuck if (w := records[r].wait) is not None})
    verdicts = [json.dumps({"v": seen[r], "msg": msg, "sets": sets}) for r in stuck]
    ins.store.multi_set([f"verdict/{r}" for r in stuck], verdicts)  # all at once: before any rank acts
    error = _fail(msg, sets)
    _await_readers(seen)
    return error


def _await_readers(seen: dict[int, int]) -> None:
    """Give the other deadlocked ranks up to ``ACK_S`` to read their verdict (they withdraw their record),
    so that none of them sees this rank exit first and reports a dead peer instead of the deadlock."""
    ins = RUNTIME.inspector
    deadline = time.monotonic() + ACK_S
    waiting = {r for r in seen if r != ins.rank}
    while waiting and time.monotonic() < deadline:
        for r in list(waiting):
            text = ins.store.get(f"rec/{r}").decode()
            if not text or Record.loads(text).version != seen[r]:
                waiting.discard(r)
        time.sleep(0.02)


def _records(mine: Record) -> dict[int, Record]:
    ins = RUNTIME.inspector
    # Every rank wrote its key in start(), before the collective that created the process sets; check
    # anyway (a missing key would make multi_get block until the store's timeout).
    keys = [f"rec/{r}" for r in range(ins.size)]
    if not ins.store.check(keys):
        return {ins.rank: mine}
    texts = ins.store.multi_get(keys)
    records = {r: Record.loads(t.decode()) for r, t in enumerate(texts) if t and r != ins.rank}
    records[ins.rank] = mine
    return records


def _fail(msg: str, sets: list[Any]) -> CollectiveMismatchError:
    ins = RUNTIME.inspector
    for ranks in sets:
        ins.broken[tuple(ranks)] = msg
    resumed()
    return CollectiveMismatchError(msg)


def published_operation() -> str | None:
    """The collective this rank has been blocked in for at least the check interval (what it published),
    or None (read by the hang report's watcher thread: no cost on the fast path)."""
    ins = RUNTIME.inspector
    mine = ins.mine
    return operation(mine.wait) if mine is not None and mine.wait is not None else None


def missing_text(wait: dict[str, Any]) -> str:
    """``wait``'s collective and the ranks missing from it, from every blocked rank's record (best effort:
    diagnostics never break the wait they describe)."""
    ins = RUNTIME.inspector
    mine = ins.mine or Record(ins.rank, ins.version, wait)
    try:
        return stalled_text(ins.rank, wait, _records(mine))
    except Exception:  # a store that fails or a record that does not parse
        return "the ranks missing from it could not be read from the job's store"


def hang_report(wait: dict[str, Any], waited: float) -> str:
    """Write the job's hang report for ``wait`` (when this rank is the one to) on stderr; return it."""
    ins = RUNTIME.inspector
    mine = ins.mine or Record(ins.rank, ins.version, wait)
    try:
        text = _hang.report(ins.store, ins.rank, ins.size, wait, _records(mine), waited,
                            operation(wait))
    except Exception:  # best effort, as missing_text
        return ""
    if text:
        sys.stderr.write(text)
        sys.stderr.flush()
    return text or ""


def resumed() -> None:
    """The wait ended (or raised): withdraw the published record."""
    ins = RUNTIME.inspector
    ins.warned = False
    ins.report = ""
    if ins.mine is not None:
        ins.mine = None
        ins.candidate = None
        try:
            ins.store.set(f"rec/{ins.rank}", "")
        except (RuntimeError, OSError):
            ins.check_s = 0.0  # the store is gone: stop inspecting


def stop() -> None:
    """Stop the hang watcher and take the wait hooks off the transport (``hvd.shutdown``; ``RUNTIME.reset()``
    then forgets the inspector's state)."""
    _hang.stop()
    transport.set_wait_hooks(None)


def check_interval() -> float:
    """Seconds a wait lasts before the stall check acts (0: off): ``PHALANX_STALL_CHECK_S``, else Horovod's
    ``HOROVOD_STALL_CHECK_DISABLE=1`` (off) and ``HOROVOD_STALL_CHECK_TIME_SECONDS``, else 5.

    Raises:
        ValueError: the value is not a number.
    """
    own = settings.STALL_CHECK.get()
    if own is not None:
        return own
    if settings.STALL_CHECK_DISABLE.get():
        return 0.0
    horovods = settings.STALL_CHECK_TIME.get()
    return DEFAULT_CHECK_S if horovods is None else horovods


def warn_after() -> float:
    """Seconds of stall before Horovod's stall warning is logged: ``HOROVOD_STALL_CHECK_TIME_SECONDS``, else
    Horovod's 60; 0 (no warning) with ``HOROVOD_STALL_CHECK_DISABLE=1``. The inspector's own time
    (:func:`check_interval`) is shorter by default and silent: a rank that is merely slow is no error.

    Raises:
        ValueError: the value is not a number.
    """
    if settings.STALL_CHECK_DISABLE.get():
        return 0.0
    horovods = settings.STALL_CHECK_TIME.get()
    return DEFAULT_WARN_S if horovods is None else horovods


def shutdown_after() -> float:
    """``HOROVOD_STALL_SHUTDOWN_TIME_SECONDS``: seconds of stall after which the waiting rank gives up with
    :class:`HorovodInternalError` (0, the default: never). As in Horovod, a value below the warning time
    (:func:`warn_after`) is ignored with a warning when the inspector starts.

    Raises:
        ValueError: the value is not a number.
    """
    return settings.STALL_SHUTDOWN_TIME.get()


def current_wait() -> dict[str, Any] | None:
    """What this rank is blocked on, from ``RUNTIME.inspector.entry`` (None when not inside an engine wait)."""
    entry = RUNTIME.inspector.entry
    if entry is None or entry.groups is None:
        return None
    ranks = entry.groups.ranks
    _issued, rounds = RUNTIME.inspector.counters()
    sig = entry.coll.sig
    phase = "payload" if rounds.get(ranks, 0) >= entry.seq else "control"
    return {"ranks": ranks, "seq": entry.seq, "phase": phase, "kind": sig.kind, "name": sig.name,
            "psid": sig.process_set_id}


def pending_operation() -> str | None:
    """The user's collective this rank waits in (``"allreduce 'loss' (process set 0, ranks [0, 1])"``), or
    None outside an engine wait; the transport names it first when a peer fails it."""
    wait = current_wait()
    return None if wait is None else operation(wait)


def on_stall(waited: float) -> CollectiveMismatchError | HorovodInternalError | None:
    """A wait has lasted ``waited`` seconds: consult the inspector (the shared-memory channels call this).

    A store that fails (its host is gone, as when an elastic job loses ranks) turns the inspector off: the
    wait goes on and the transport reports the failure, as without the inspector. At the warning time the
    rank logs Horovod's stall warning naming the ranks missing from the collective, and the first rank of
    the collective to get there writes the job's hang report (``hang``).
    """
    ins = RUNTIME.inspector
    if ins.check_s <= 0 or waited < ins.check_s:
        return None
    wait = current_wait()
    if wait is None:
        return None
    if 0 < ins.warn_s <= waited and not ins.warned:  # Horovod's stall warning, once per wait
        ins.warned = True
        _log.warning("stall check: %s %r on ranks %s has waited %.0f s for the other ranks (rank %d; "
                     "HOROVOD_STALL_CHECK_TIME_SECONDS): %s", wait["kind"], wait["name"], list(wait["ranks"]), waited,
                     ins.rank, missing_text(wait))
        ins.report = hang_report(wait, waited)
    if 0 < ins.shutdown_s <= waited:
        report = ins.report
        missing_ = missing_text(wait)
        resumed()
        return HorovodInternalError(
            f"stall check: {wait['kind']} {wait['name']!r} on ranks {list(wait['ranks'])} waited {waited:.0f} s, "
            f"past {env_names.HOROVOD_STALL_SHUTDOWN_TIME_SECONDS}={ins.shutdown_s:g}: {missing_}"
            + (f"\n{report}" if report else ""))
    try:
        return stalled(wait)
    except (RuntimeError, OSError):
        ins.check_s, ins.mine = 0.0, None
        return None


def _wait_for(work: Any, timeout: timedelta) -> bool:
    """``work.wait(timeout)``; False when it timed out (a failed work re-raises its own error)."""
    try:
        work.wait(timeout)
        return True
    except RuntimeError:
        if not work.is_completed():
            return False
    try:
        work.wait()  # finished after all, or failed: its own error
    except Exception as e:
        error = verdict()  # a deadlocked peer that raised and exited first
        if error is not None:
            raise error from e
        raise
    return True


def wait(work: Any) -> None:
    """``work.wait()`` of a CPU (gloo or shared-memory) work, with the stall inspector.

    Raises:
        CollectiveMismatchError: this rank is part of a confirmed deadlock.
        HorovodInternalError: the stall shutdown time passed.
        Exception: the work's own error (a peer gone), with a note naming the collective and the missing ranks.
    """
    try:
        _wait_inspected(work)
    except (CollectiveMismatchError, HorovodInternalError):
        raise
    except Exception as e:
        _note_failed_wait(e)
        raise


def _wait_inspected(work: Any) -> None:
    inspector = RUNTIME.inspector
    if inspector.check_s <= 0:
        work.wait()
        return
    if _wait_for(work, inspector.check_td):
        return
    try:
        waited = inspector.check_s
        while True:
            error = on_stall(waited)
            if error is not None:
                raise error
            if _wait_for(work, inspector.poll_td):
                return
            waited += inspector.poll_td.total_seconds()
    finally:
        resumed()


def _note_failed_wait(error: Exception) -> None:
    """Add to a transport's own error (gloo's "connection closed by peer") the user's collective that failed
    and the ranks missing from it."""
    wait = current_wait()
    if wait is None or isinstance(error, CollectiveMismatchError) or not hasattr(error, "add_note"):
        return
    error.add_note(f"phalanx: this rank was in {missing_text(wait)}")


def broken(ranks: Ranks) -> CollectiveMismatchError | None:
    """The error for a collective on a membership abandoned in a deadlock, else None."""
    msg = RUNTIME.inspector.broken.get(ranks)
    if msg is None:
        return None
    return CollectiveMismatchError(
        f"process set ranks {list(ranks)} cannot run collectives any more: an earlier collective on it was "
        f"abandoned ({msg})"
    )
