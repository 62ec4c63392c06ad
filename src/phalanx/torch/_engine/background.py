"""The background thread that runs the ``*_async`` collectives (Horovod's asynchrony).

``hvd.allreduce_async(t)`` and its kin queue the whole collective (negotiation and payload) as a *job* and
return a handle at once; one daemon thread runs the jobs in issue order, so the engine still sees the
collectives in the order this rank issued them, and ``poll`` is False until the job has moved the data. A
job whose collective waits for peers that have not issued its name yet ends early with the engine's handle
(``_engine.Parked``), so that this rank's later collectives are not held up behind it.

The synchronous calls (``hvd.allreduce``...) do not hand over to the thread: they run on the caller's thread
(no thread switch on the fast path). Before any collective reaches the engine from outside a job,
:func:`drain` waits for the queued jobs, so the engine is only ever used by one thread at a time and the
order of issue is kept (a synchronous call after ``*_async`` runs after it, as on every other rank).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from phalanx.errors import HorovodInternalError, InvalidArgumentError
from phalanx.torch._runtime import FIRST_ASYNC_HANDLE, RUNTIME, Runner


@dataclass
class Job:
    """One queued collective and, once run, its outcome."""

    run: Callable[[], Any]
    name: str
    done: threading.Event = field(default_factory=threading.Event)
    result: Any = None
    error: BaseException | None = None


def _loop(runner: Runner) -> None:
    """The background thread: run the queued jobs in issue order, for the life of the process."""
    while True:
        with runner.cond:
            while not runner.queue:
                runner.cond.wait()
            job = runner.queue.popleft()
        try:
            job.result = job.run()
        except BaseException as e:  # handed to synchronize(); the thread goes on with the next job
            job.error = e
        with runner.cond:
            if job.name:  # from now on the engine holds the name while its collective is pending
                runner.finished.add(job.name)
            runner.busy -= 1
            job.done.set()
            runner.cond.notify_all()


def _start_thread() -> None:
    runner = RUNTIME.runner
    runner.thread = threading.Thread(target=_loop, args=(runner,), name="phalanx-async", daemon=True)
    runner.thread.start()


def prepare() -> None:
    """Start the background thread if it is not running (``hvd.init``: the first ``*_async`` then returns
    without paying for the thread's start)."""
    with RUNTIME.runner.cond:
        if RUNTIME.runner.thread is None:
            _start_thread()


def in_worker() -> bool:
    """Whether the caller is the background thread (inside a job)."""
    return threading.current_thread() is RUNTIME.runner.thread


def start(run: Callable[[], Any], name: str, busy: Callable[[str], bool]) -> int:
    """Queue ``run`` (a whole collective); returns its handle.

    Args:
        run: the job.
        name: the collective's name ('' when unnamed).
        busy: whether the engine holds a collective of that name that has not finished.

    Raises:
        ValueError: a queued or running job, or an unfinished collective, has the same (non-empty) name.
    """
    runner = RUNTIME.runner
    with runner.cond:
        if name and (name in runner.inflight or busy(name)):
            raise InvalidArgumentError(
                f"a collective named {name!r} is already in flight; synchronize() it first or give the new "
                "one a different name="
            )
        if runner.thread is None:
            _start_thread()
        job = Job(run, name)
        handle = runner.next_handle
        runner.next_handle += 1
        runner.jobs[handle] = job
        if name:
            runner.inflight.add(name)
        runner.queue.append(job)
        runner.busy += 1
        runner.cond.notify_all()
    return handle


def is_handle(handle: int) -> bool:
    """Whether ``handle`` came from :func:`start`."""
    return handle >= FIRST_ASYNC_HANDLE


def poll(handle: int) -> tuple[bool, Any]:
    """Whether the job has finished, and then its result (never blocks).

    Raises:
        ValueError: the handle is unknown or was already synchronized.
    """
    job = _job(handle)
    done = job.done.is_set()
    return done, job.result if done else None


def idle() -> bool:
    """Whether no job is queued or running (the caller's thread may then use the engine)."""
    return not RUNTIME.runner.busy


def wait(handle: int) -> Any:
    """Wait for the job and return its result (or raise its error); forgets the handle."""
    job = _job(handle)
    job.done.wait()
    with RUNTIME.runner.cond:
        RUNTIME.runner.jobs.pop(handle, None)
        RUNTIME.runner.inflight.discard(job.name)
        RUNTIME.runner.finished.discard(job.name)
    if job.error is not None:
        raise job.error
    return job.result


def _job(handle: int) -> Job:
    job = RUNTIME.runner.jobs.get(handle)
    if job is None:
        raise InvalidArgumentError(f"handle {handle!r} is unknown or was already synchronized")
    return job


def drain() -> None:
    """Wait until every queued job has run (a no-op on the background thread and when nothing is queued);
    the names of the jobs that have ended are free again."""
    runner = RUNTIME.runner
    if not (runner.busy or runner.finished) or in_worker():
        return
    if runner.busy:
        with runner.cond:
            while runner.busy:
                runner.cond.wait()
    if runner.finished:
        with runner.cond:
            runner.inflight -= runner.finished
            runner.finished.clear()


def abandon(reason: str) -> None:
    """Fail the jobs not started yet with ``reason`` and wait for the running one (``hvd.shutdown``); the
    results of finished jobs are forgotten."""
    runner = RUNTIME.runner
    with runner.cond:
        while runner.queue:
            job = runner.queue.popleft()
            job.error = HorovodInternalError(reason)
            runner.busy -= 1
            job.done.set()
    drain()
    with runner.cond:
        runner.jobs.clear()
        runner.inflight.clear()
        runner.finished.clear()
