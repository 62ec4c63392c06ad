"""Watch a running job: route logs, collect results in rank order, decide failure.

Launchers feed one queue with channel events and :class:`RankExit` events (posted once a rank's process
has ended and its output is drained). The monitor runs in the caller's thread, so console writes happen
there (notebook friendly) and a KeyboardInterrupt lands in it.
"""

from __future__ import annotations

import queue
import reprlib
import socket
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import cloudpickle

from phalanx.errors import (
    PayloadError,
    PhalanxError,
    RankFailure,
    StartTimeoutError,
    WorkerFailedError,
    describe_exit,
    lost_peer_rank,
)
from phalanx.job.channel import Custom, Event, Result
from phalanx.job.logs import LogSink, TailBuffer
from phalanx.job.observation import JobEnded, Observer, RankEnded, RankStarted
from phalanx.job.progress import Progress
from phalanx.job.records import ErrorRecord, Hello, LogLine
from phalanx.job.report import read_failure
from phalanx.job.spool import Spooled
from phalanx.job.stats import RankStats

_POLL_S = 0.05
#: Exit codes a worker uses when it was stopped on purpose (SIGTERM's shell code, and the watchdog's).
_STOPPED_CODES = {-15, -9, 143, 137}
#: Of those, SIGKILL's: the teardown sends it only once its grace after SIGTERM is over.
_KILLED_CODES = {-9, 137}


@dataclass(frozen=True)
class RankExit:
    """A rank's process ended and its output has been drained.

    Attributes:
        rank: the rank.
        returncode: ``Popen.returncode``.
        ended_at: ``time.monotonic()`` on the driver when the process ended (its output is drained
            afterwards, which may take seconds); None: when this event arrived.
    """

    rank: int
    returncode: int
    ended_at: float | None = None


@dataclass
class _RankState:
    hello: bool = False
    exited: bool = False
    returncode: int | None = None
    result: bytes | Spooled | None = None
    error: ErrorRecord | None = None
    failed_at: float | None = None
    host: str = ""  # where the rank said it runs (its hello)


@dataclass(frozen=True)
class MonitorConfig:
    """How to judge a job.

    Attributes:
        world_size: number of ranks.
        expect_results: True for function jobs (a rank must send a result), False for commands.
        expect_hello: True when each rank connects to the channel (function jobs).
        start_timeout_s: seconds for every rank to say hello.
        start_timeout_hint: the argument or variable that raises the start timeout, for the error.
        stop_wait_s: after a failure, seconds to wait for the other ranks to go.
        teardown_grace_s: seconds the teardown waits between SIGTERM and SIGKILL (a rank SIGKILLed sooner
            after the job was stopped was killed by someone else: a failure of its own, not a stopped rank).
        rank_hosts: the host of each rank when the launcher placed them (failures name it); empty: the host
            each rank's hello named (Spark, where the cluster places them), else this machine's.
        raw_results: return each rank's result as the bytes it sent (a launcher that runs away from the
            user's code, e.g. in a Spark Connect task, leaves unpickling to the client).
    """

    world_size: int
    expect_results: bool
    expect_hello: bool
    start_timeout_s: float
    start_timeout_hint: str
    stop_wait_s: float = 10.0
    teardown_grace_s: float = 3.0
    rank_hosts: Sequence[str] = ()
    raw_results: bool = False


@dataclass
class JobMonitor:
    """Consumes a job's events until every rank is done or one failed."""

    config: MonitorConfig
    events: queue.Queue[Event | RankExit]
    sinks: Sequence[LogSink]
    stop_all: Callable[[], None]
    on_custom: Callable[[Custom], None] | None = None
    tail: TailBuffer = field(default_factory=TailBuffer)
    #: Told of each rank's start, stats, log lines and end, and of the verdict (:mod:`phalanx.job.observation`).
    observer: Observer | None = None
    progress: Progress | None = None
    #: Called in the monitor's thread at every poll and before a rank's start is counted (a launcher's progress
    #: counts what it starts).
    on_tick: Callable[[], None] | None = None
    _ranks: list[_RankState] = field(init=False)
    _stopped_at: float | None = field(init=False, default=None)

    def __post_init__(self) -> None:
        self._ranks = [_RankState() for _ in range(self.config.world_size)]

    def run(self) -> list[Any]:
        """Block until the job ends; return each rank's value in rank order.

        Raises:
            WorkerFailedError: a rank raised, exited non-zero or died by a signal.
            StartTimeoutError: some ranks did not start within the start timeout.
        """
        try:
            if self.observer is None:
                return self._judge()
            try:
                values = self._judge()
            except PhalanxError as e:
                self.observer(JobEnded(ok=False, report=str(e)))
                raise
        finally:
            if self.progress is not None:
                self.progress.finish()  # a job that never printed: its terminal line goes before the verdict
        self.observer(JobEnded(ok=True, report=_result_summary(values), ranks=range(len(values))))
        return values

    def _judge(self) -> list[Any]:
        started = time.monotonic()
        while not all(r.exited for r in self._ranks):
            self._drain(timeout=_POLL_S)
            self._check_start(started)
            if self._stopped_at is not None and time.monotonic() - self._stopped_at > self.config.stop_wait_s:
                break
        self._flush()
        failures = self._failures()
        if failures:
            for state in self._ranks:
                if isinstance(state.result, Spooled):
                    state.result.close()
            raise WorkerFailedError(failures)
        return [self._load(rank, state) for rank, state in enumerate(self._ranks)]

    def _drain(self, timeout: float) -> None:
        try:
            event = self.events.get(timeout=timeout)
        except queue.Empty:
            self._flush()
            if self.on_tick is not None:
                self.on_tick()
            return
        self._handle(event)
        for _ in range(10000):
            try:
                self._handle(self.events.get_nowait())
            except queue.Empty:
                break
        self._flush()
        if self.on_tick is not None:
            self.on_tick()

    def _handle(self, event: Event | RankExit) -> None:
        if isinstance(event, LogLine):
            if self.progress is not None:
                self.progress.clear()
            for sink in self.sinks:
                sink.write(event)
            self.tail.write(event)
        else:
            self._record(event)
        if self.observer is not None:
            self._tell(self.observer, event)

    def _record(self, event: Event | RankExit) -> None:
        state = self._ranks[event.rank]
        if isinstance(event, Hello):
            state.hello = True
            state.host = event.host
            if self.on_tick is not None:
                self.on_tick()  # what the launcher counts (the tasks that started) is told before this rank
            self._started()
        elif isinstance(event, Result):
            state.result = event.value
        elif isinstance(event, ErrorRecord):
            state.error = event
            self._fail(state, event.at)
        elif isinstance(event, RankExit):
            self._exited(state, event.returncode, event.ended_at)
        elif isinstance(event, Custom) and self.on_custom is not None:
            self.on_custom(event)

    def _tell(self, observer: Observer, event: Event | RankExit) -> None:
        """Pass what an observer sees of ``event`` on (after the monitor judged it)."""
        if isinstance(event, (LogLine, RankStats)):
            observer(event)
        elif isinstance(event, Hello):
            observer(RankStarted(event.rank, event.pid, event.host, time.monotonic()))
        elif isinstance(event, RankExit):
            state = self._ranks[event.rank]
            if state.failed_at is None:
                observer(RankEnded(event.rank, event.returncode, False))
                return
            others = [s.failed_at for s in self._ranks if s is not state and s.failed_at is not None]
            stopped = bool(others) and min(others) < state.failed_at and self._was_stopped(state, min(others))
            cause = self._describe(event.rank, state, stopped).summary
            observer(RankEnded(event.rank, event.returncode, True, cause, stopped))

    def _started(self) -> None:
        if self.progress is None:
            return
        started = sum(r.hello for r in self._ranks)
        self.progress.count("ranks started", started, self.config.world_size)
        if started >= self.config.world_size:
            self.progress.finish()

    def _exited(self, state: _RankState, returncode: int, ended_at: float | None) -> None:
        state.exited = True
        state.returncode = returncode
        if returncode != 0 or (self.config.expect_results and state.result is None):
            self._fail(state, ended_at)

    def _fail(self, state: _RankState, at: float | None = None) -> None:
        """Record a failure that happened at ``at`` (now when None): the root cause is the rank that failed
        first, by when it failed, not by when the driver heard of it (a killed rank's exit is posted only
        after its output is drained, and a survivor's error about the lost peer may arrive before it)."""
        at = time.monotonic() if at is None else at
        if state.failed_at is None or at < state.failed_at:
            state.failed_at = at
        if self._stopped_at is None:
            self._stopped_at = time.monotonic()
            self.stop_all()

    def _check_start(self, started: float) -> None:
        if not self.config.expect_hello or self._stopped_at is not None:
            return
        if time.monotonic() - started <= self.config.start_timeout_s:
            return
        missing = [r for r, s in enumerate(self._ranks) if not s.hello and not s.exited]
        if not missing:
            return
        self._stopped_at = time.monotonic()
        self.stop_all()
        raise StartTimeoutError(
            f"rank(s) {', '.join(map(str, missing))} of {self.config.world_size} did not start within "
            f"{self.config.start_timeout_s:g} s; raise {self.config.start_timeout_hint} if the workers "
            "need longer to start (slow imports, busy machine)"
        )

    def _flush(self) -> None:
        for sink in self.sinks:
            sink.flush()

    def _failures(self) -> list[RankFailure]:
        failed = [(r, s) for r, s in enumerate(self._ranks) if s.failed_at is not None]
        failed.sort(key=lambda item: (item[1].failed_at or 0.0, item[0]))
        stop = failed[0][1].failed_at if failed else None
        failed = _blamed_first(failed)
        out = [self._describe(r, s, secondary=False) for r, s in failed[:1]]
        out += [self._describe(r, s, secondary=self._was_stopped(s, stop)) for r, s in failed[1:]]
        return out

    def _was_stopped(self, state: _RankState, stop: float | None) -> bool:
        if state.error is not None or state.returncode not in _STOPPED_CODES or stop is None:
            return False
        if state.returncode in _KILLED_CODES and self._stopped_at is not None and state.failed_at is not None:
            return state.failed_at >= self._stopped_at + self.config.teardown_grace_s
        return True

    def _describe(self, rank: int, state: _RankState, secondary: bool) -> RankFailure:
        rc = state.returncode
        tail = self.tail.tail(rank)
        # A command rank that exited with a code (not a signal) printed its uncaught exception last.
        output = tail if state.error is None and rc is not None and rc > 0 else ()
        found = read_failure(state.error.traceback if state.error else "", output)
        if state.error is not None:
            summary = state.error.summary
        elif found.exception and rc:  # a command rank's uncaught exception
            summary = f"{found.exception} (process ended with {describe_exit(rc)})"
        elif rc is not None and rc != 0:
            summary = f"process ended with {describe_exit(rc)}"
        else:
            summary = "process exited with code 0 without reporting a result (did it call os._exit?)"
        hosts = self.config.rank_hosts
        return RankFailure(
            rank=rank,
            summary=summary,
            traceback=found.traceback,
            log_tail=tail,
            returncode=state.returncode,
            exc_type=state.error.exc_type if state.error else None,
            secondary=secondary,
            host=hosts[rank] if rank < len(hosts) else state.host or socket.gethostname(),
            where=found.where,
            traceback_shown=found.from_output,
        )

    def _load(self, rank: int, state: _RankState) -> Any:
        result, state.result = state.result, None  # a spooled result is read once, its file then closed
        if isinstance(result, Spooled) and self.config.raw_results:
            return result.read()
        if result is None or self.config.raw_results:
            return result
        try:
            return result.load() if isinstance(result, Spooled) else cloudpickle.loads(result)
        except Exception as e:
            raise PayloadError(
                f"rank {rank}'s return value cannot be unpickled on the driver: {type(e).__name__}: {e}. "
                "Return plain Python objects or tensors; types defined only on the workers cannot be loaded."
            ) from e


_SHORT = reprlib.Repr()
_SHORT.maxstring = _SHORT.maxother = 200


def _result_summary(values: list[Any]) -> str:
    """What the job returned, in a line an observer can show (rank 0's value, shortened)."""
    if not values:
        return "the job finished"
    first = values[0]
    shown = f"{len(first)} bytes" if isinstance(first, (bytes, bytearray)) else _SHORT.repr(first)
    return f"every rank finished; rank 0 returned {shown}"


def _blamed_first(failed: list[tuple[int, _RankState]]) -> list[tuple[int, _RankState]]:
    """Put first the rank that the first failure names as dead (a shared-memory wait that saw its peer's
    process gone), if that rank failed too: under load the survivor's error can reach the driver, and be
    dated, before the dead rank's exit or its own error, which are nonetheless its cause."""
    if len(failed) < 2 or failed[0][1].error is None:
        return failed
    blamed = lost_peer_rank(failed[0][1].error.message)
    for i, (rank, _state) in enumerate(failed[1:], start=1):
        if rank == blamed:
            return [failed[i], *failed[:i], *failed[i + 1:]]
    return failed
