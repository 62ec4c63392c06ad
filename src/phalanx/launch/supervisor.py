"""One rank supervised away from the driver: its process, its output forwarded, its end reported.

A supervisor (a Spark barrier task, or the agent a hosts job starts over ssh) connects to the driver's
channel as ``Role.SUPERVISOR`` for the rank, starts the rank's process, forwards each output line as a
``LOG`` frame, stops the process tree when the driver sends ABORT or goes away, and reports the exit
code as an ``EVENT`` frame (:func:`exit_event`) once the output is drained. Lines are read from pipes by
the supervisor, not by the rank, so a rank that is SIGKILLed cannot lose what it already wrote.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from phalanx.errors import ChannelError
from phalanx.job.channel import Custom, DriverChannel, WorkerChannel
from phalanx.job.framing import Kind
from phalanx.job.logs import pump_lines
from phalanx.job.monitor import RankExit
from phalanx.job.records import ErrorRecord, LogLine, Stream
from phalanx.launch import warm
from phalanx.launch.core import DRAIN_WAIT_S, spawn_rank
from phalanx.launch.fr_dump import DumpDir
from phalanx.launch.proctree import terminate_tree
from phalanx.launch.warm import RankProcess

#: Exit code reported when the supervisor could not start its rank.
EXIT_NOT_STARTED = 1


def exit_event(returncode: int, ended_at: float | None = None) -> bytes:
    """Body of the EVENT frame a supervisor sends once its rank ended and its output was drained.

    Args:
        returncode: the rank's exit code.
        ended_at: ``time.monotonic()`` here when the rank's process ended; sent as the seconds since (clocks
            of two hosts cannot be compared), so the driver can order failures by when they happened.
    """
    age = 0.0 if ended_at is None else max(0.0, time.monotonic() - ended_at)
    return json.dumps({"exit": returncode, "dead_for_s": age}).encode()


def parse_exit_age(body: bytes) -> float:
    """Seconds the rank had been dead when its supervisor sent the exit event (0 when not given)."""
    try:
        return max(0.0, float(json.loads(body).get("dead_for_s", 0.0)))
    except (ValueError, TypeError, AttributeError):
        return 0.0


#: Body of a supervisor's heartbeat (an EVENT frame every :data:`HEARTBEAT_S` while its rank runs).
HEARTBEAT = b'{"beat": 1}'
#: Seconds between a host agent's supervisors' heartbeats.
HEARTBEAT_S = 1.0


def parse_exit_event(body: bytes) -> int | None:
    """The exit code in a supervisor's EVENT body, or None when the body is not an exit event."""
    try:
        decoded = json.loads(body)
        return int(decoded["exit"]) if isinstance(decoded, dict) and "exit" in decoded else None
    except (ValueError, TypeError, KeyError):
        return None


class RankSupervisor:
    """One rank's process and its forwarding threads.

    Args:
        channel: this rank's supervisor connection to the driver.
        rank: the channel rank (worker id) whose output this forwards.
        teardown_grace_s: seconds between SIGTERM and SIGKILL when the driver aborts the job.
        aborted: set by whoever reads the driver's frames (elastic tasks); None: this supervisor reads them.
        heartbeat: send :data:`HEARTBEAT` every :data:`HEARTBEAT_S` while the rank runs (host agents).
    """

    def __init__(self, channel: WorkerChannel, rank: int, teardown_grace_s: float,
                 aborted: threading.Event | None = None, heartbeat: bool = False) -> None:
        self.channel = channel
        self.rank = rank
        self.teardown_grace_s = teardown_grace_s
        self.proc: RankProcess | None = None
        #: ``time.monotonic()`` when the rank's process ended (None while it runs)
        self.ended_at: float | None = None
        self.channel_ok = True
        self._done = threading.Event()
        self._aborted = aborted
        self._heartbeat = heartbeat

    def send(self, kind: Kind, body: bytes) -> None:
        """Send a frame; after the driver went away, keep going silently (the pipes must be drained)."""
        if not self.channel_ok:
            return
        try:
            self.channel.send(kind, body)
        except ChannelError:
            self.channel_ok = False

    def emit(self, line: LogLine) -> None:
        """Forward one output line of the rank."""
        self.send(Kind.LOG, line.encode())

    def run(self, argv: Sequence[str], env: dict[str, str], template: warm.TemplateLink | None = None,
            cwd: str | None = None, python: dict[str, Any] | None = None) -> int:
        """Start the rank (from the calling thread: its parent-death signal follows this thread; from
        ``template`` when given, see ``core.spawn_rank``), forward its output, stop it on abort; return its
        exit code."""
        if self._heartbeat:
            self._start_beating()
        dumps = DumpDir.create(env)
        try:
            self.proc = spawn_rank(argv, {**env, **dumps.env()}, template, cwd, python)
        except BaseException:
            self._done.set()
            dumps.collect(failed=False)
            raise
        assert self.proc.stdout is not None and self.proc.stderr is not None
        pumps = [
            threading.Thread(target=pump_lines, args=(self.proc.stdout, self.rank, Stream.STDOUT, self.emit)),
            threading.Thread(target=pump_lines, args=(self.proc.stderr, self.rank, Stream.STDERR, self.emit)),
        ]
        for t in pumps:
            t.daemon = True
            t.start()
        threading.Thread(target=self._abort_watch, name="phalanx-abort", daemon=True).start()
        try:
            returncode = self.proc.wait()
            self.ended_at = time.monotonic()
        finally:
            self._done.set()
            terminate_tree([self.proc.pid], 0.5)
        for t in pumps:
            t.join(DRAIN_WAIT_S)
        for line in dumps.collect(failed=returncode != 0):
            self.emit(LogLine(self.rank, Stream.STDERR, line))
        return returncode

    def stop(self, grace_s: float | None = None) -> None:
        """Stop the rank's whole process tree now (SIGTERM, grace, SIGKILL)."""
        if self.proc is not None and not self._done.is_set():
            terminate_tree([self.proc.pid], self.teardown_grace_s if grace_s is None else grace_s)

    def _start_beating(self) -> None:
        """Tell the driver this host is alive from before the rank starts until it ends (a silent host is told
        apart by its missing heartbeats: a cut link sends no reset).

        The first beat is sent here, before the rank exists, on the connection that will carry its lines: the
        driver has it before any of them. The driver names only a host it has heard beat, and a rank forked
        from a warm template can be past its first collective within :data:`HEARTBEAT_S`: a link cut then would
        leave the host unnamed until the survivors' gloo timeout if its first beat waited for the period."""
        self.send(Kind.EVENT, HEARTBEAT)
        threading.Thread(target=self._beat, name="phalanx-heartbeat", daemon=True).start()

    def _beat(self) -> None:
        while not self._done.wait(HEARTBEAT_S) and self.channel_ok:
            self.send(Kind.EVENT, HEARTBEAT)

    def _abort_watch(self) -> None:
        if self._aborted is not None:
            self._aborted.wait()
        else:
            self.channel.wait_for_abort()
        self.stop()


#: Seconds between looks at the worker connections of exits still waiting for their drain.
_DRAIN_POLL_S = 0.01


@dataclass(eq=False)
class _Pending:
    rank: int
    returncode: int
    ended_at: float
    deadline: float


class ExitReports:
    """The driver's side of the supervisors' exit reports: each rank's end posted once as a ``RankExit``.

    A supervisor's exit event is posted only once the rank's own worker connection has been read out (a
    function job's result travels there, and may still be in flight), or :data:`DRAIN_WAIT_S` after it
    arrived. The waits are held by one thread, started when the first exit waits and ended when none does,
    whatever the number of ranks. Used by every launcher whose ranks are supervised away from the driver
    (Spark tasks, host agents).

    Args:
        function_job: True when ranks connect themselves (a result must be waited for).
    """

    def __init__(self, function_job: bool) -> None:
        self.function_job = function_job
        self.lock = threading.Lock()
        #: Ranks (worker ids) whose end was posted.
        self.exited: set[int] = set()
        self._channel: DriverChannel | None = None
        self._waiting: list[_Pending] = []
        self._drainer: threading.Thread | None = None

    def attach(self, channel: DriverChannel) -> None:
        """The job's channel (its queue receives the exits); call before any event arrives."""
        self._channel = channel

    def on_event(self, event: Custom) -> bool:
        """Handle a supervisor's EVENT frame; False when it is not an exit report."""
        returncode = parse_exit_event(event.body)
        if returncode is None:
            return False
        now = time.monotonic()
        pending = _Pending(event.rank, returncode, now - parse_exit_age(event.body), now + DRAIN_WAIT_S)
        with self.lock:
            self._waiting.append(pending)
            if self._drainer is None:
                self._drainer = threading.Thread(target=self._drain, name="phalanx-exit-reports", daemon=True)
                self._drainer.start()
        return True

    def _drained(self, pending: _Pending) -> bool:
        assert self._channel is not None
        if not self.function_job or not self._channel.is_connected(pending.rank):
            return True
        return self._channel.worker_done(pending.rank, 0) or time.monotonic() >= pending.deadline

    def _drain(self) -> None:
        """Post every waiting exit once its rank's worker connection is read out; end when none waits."""
        while True:
            with self.lock:
                waiting, self._waiting = self._waiting, []
            still: list[_Pending] = []
            for p in waiting:
                if self._drained(p):
                    self.post(p.rank, p.returncode, ended_at=p.ended_at)
                else:
                    still.append(p)
            with self.lock:
                self._waiting[:0] = still
                if not self._waiting:
                    self._drainer = None
                    return
                idle = len(still) == len(waiting)
            if idle:
                time.sleep(_DRAIN_POLL_S)

    def post(self, rank: int, returncode: int, error: str = "", ended_at: float | None = None) -> None:
        """Post ``rank``'s end (and ``error`` as its error record first), unless it was posted already;
        ``ended_at``: ``time.monotonic()`` here when the rank's process ended (None: now)."""
        with self.lock:
            if rank in self.exited:
                return
            self.exited.add(rank)
        assert self._channel is not None
        if error:
            self._channel.events.put(ErrorRecord(rank=rank, exc_type="phalanx.errors.ChannelError",
                                                 message=error, traceback=""))
        self._channel.events.put(RankExit(rank=rank, returncode=returncode, ended_at=ended_at))

    def reported(self, ranks: Iterable[int]) -> bool:
        """Whether every one of ``ranks`` was posted."""
        with self.lock:
            return all(r in self.exited for r in ranks)
