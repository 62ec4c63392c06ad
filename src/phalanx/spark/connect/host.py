"""The job's driver side, run inside rank 0's task of a Spark Connect job.

Under Spark Connect the client may be unreachable from the executors, so rank 0's task does what the
driver does in a classic job: it hosts the channel and the rendezvous store (advertised at the
executor address Spark gives the task), runs the job monitor, and ends with an
:class:`~phalanx.spark.connect.wire.Outcome`. It is the classic launcher's driver with another rank starter
(:class:`HostedStage`: the tasks run already, nothing to submit or cancel); an elastic job's slot commands
and rounds work unchanged. Log records go through a :class:`LogRelay`: live over an authenticated link
to the client when the task reached it (probed with a short timeout), else kept for the outcome.
"""

from __future__ import annotations

import json
import logging
import pickle
import socket
import threading
from typing import Any

from phalanx.env import JobContract
from phalanx.errors import ChannelError, SparkJobError
from phalanx.job.channel import DriverChannel, Role, WorkerChannel
from phalanx.job.framing import Kind
from phalanx.job.monitor import JobMonitor
from phalanx.job.records import LogLine
from phalanx.launch.core import JobSpec
from phalanx.launch.driver import DriverAddress, JobDriver
from phalanx.launch.elasticity import Elasticity, ElasticSpec
from phalanx.spark.connect.wire import LogRecord, Outcome
from phalanx.spark.launcher import BarrierTasks, Rank0Stdout
from phalanx.spark.task import TaskSpec

log = logging.getLogger(__name__)

#: Bytes of log records rank 0's task keeps for the outcome when they cannot stream live; more is dropped
#: (counted, and said in the client's log).
RETURN_LOG_BYTES = 64 << 20


class LogRelay:
    """The hosted monitor's log sink: streams records to the client, or keeps them for the outcome.

    Thread-safe: the monitor writes and flushes from its thread, the probe attaches the link from another.
    """

    def __init__(self, budget_bytes: int = RETURN_LOG_BYTES) -> None:
        self.link_error = "the client's address was not probed yet"
        self.dropped = 0
        self._budget = budget_bytes
        self._kept_bytes = 0
        self._pending: list[LogRecord] = []
        self._link: WorkerChannel | None = None
        self._lock = threading.Lock()

    def attach(self, link: WorkerChannel) -> None:
        """Stream from now on: the records kept so far go first."""
        with self._lock:
            self._link, self.link_error = link, ""
            self._send()

    def unreachable(self, why: str) -> None:
        """Record why the client cannot be reached (the records stay for the outcome)."""
        with self._lock:
            self.link_error = why

    def write(self, line: LogLine) -> None:
        """A line of a rank's output."""
        self._record((line.rank, line.stream.label, line.text))

    def message(self, rank: int, text: str) -> None:
        """A ``log_to_driver`` message."""
        self._record((rank, "message", text))

    def flush(self) -> None:
        """Send what is pending when the link is up."""
        with self._lock:
            self._send()

    def close(self) -> list[LogRecord]:
        """Send the last records, close the link; return the records the client has not received."""
        with self._lock:
            self._send()
            if self._link is not None:
                self._link.close()
                self._link = None
            left, self._pending = self._pending, []
            return left

    def _record(self, record: LogRecord) -> None:
        with self._lock:
            if self._link is None:
                size = len(record[2]) + 16
                if self._kept_bytes + size > self._budget:
                    self.dropped += 1
                    return
                self._kept_bytes += size
            self._pending.append(record)

    def _send(self) -> None:
        if self._link is None or not self._pending:
            return
        try:
            self._link.send(Kind.EVENT, json.dumps({"logs": self._pending}).encode())
        except ChannelError as e:
            self._link.close()
            self._link = None
            self.link_error = f"the live log link to the client broke: {e}"
            return
        self._pending = []
        self._kept_bytes = 0


def probe_client(relay: LogRelay, address: str, secret: str, timeout_s: float) -> None:
    """Connect to the client's log link (``address``, authenticated with ``secret``); attach it or say why not."""
    if not address:
        relay.unreachable("the client offered no log link")
        return
    try:
        link = WorkerChannel.connect(address, secret, 0, Role.SUPERVISOR, timeout_s)
    except ChannelError as e:
        relay.unreachable(f"rank 0's task could not reach the client at {address} within {timeout_s:g} s ({e})")
        return
    relay.attach(link)


class HostedStage:
    """The ranks as children of the tasks of the stage this driver runs in (a
    :class:`~phalanx.launch.driver.RankStarter`): they start themselves once the barrier round told them the
    job's address; stopping sends ABORT to every task (there is nothing to cancel from inside the stage)."""

    def __init__(self, tasks: BarrierTasks) -> None:
        self.tasks = tasks

    def start(self, job: JobContract, channel: DriverChannel) -> None:
        """Nothing to start: the tasks run already; their reports arrive on ``channel``."""
        self.tasks.attach(channel)

    def stop(self, grace_s: float) -> None:
        """ABORT every task; each stops its ranks' process trees within its own teardown grace."""
        self.tasks.abort()

    def unfinished(self) -> list[int]:
        """See :class:`~phalanx.spark.launcher.BarrierTasks`."""
        return self.tasks.unfinished()

    def close(self) -> None:
        """Nothing to reap here: every task ends with its ranks."""


class HostedJob:
    """A Connect job's driver side in rank 0's task: the one :class:`~phalanx.launch.driver.JobDriver` with a
    :class:`HostedStage`, its monitor in a thread of its own while this task supervises its rank.

    Args:
        spec: the job.
        run_id: the job's id (the client's).
        elastic: the elastic policy (lost workers are replaced in their slots), or None for a plain job.
    """

    def __init__(self, spec: JobSpec, run_id: str, elastic: ElasticSpec | None = None) -> None:
        self.relay = LogRelay()
        self.rank0_stdout = Rank0Stdout()
        self.tasks = BarrierTasks(spec, elastic, self.relay.message)
        self.elasticity = Elasticity(elastic, self.tasks, spec.np, spec.np) if elastic is not None else None
        self.driver = JobDriver(spec, HostedStage(self.tasks), DriverAddress.loopback(),
                                [self.rank0_stdout, self.relay], run_id=run_id, elasticity=self.elasticity,
                                on_custom=self.tasks.on_custom, raw_results=True)
        self.values: list[Any] = []
        self._error: BaseException | None = None
        self._monitor_thread: threading.Thread | None = None

    def host(self, advertise: str) -> JobContract:
        """Open the channel and the store on this executor, start the monitor; return the job's contract."""
        self.driver.address = DriverAddress(bind=_bind_host(advertise), advertise=advertise)
        job, monitor = self.driver.open()
        assert self.driver.channel is not None
        self.driver.starter.start(job, self.driver.channel)
        self._monitor_thread = threading.Thread(target=self._watch, args=(monitor,), name="phalanx-host", daemon=True)
        self._monitor_thread.start()
        return job

    def task_spec(self, job: JobContract) -> TaskSpec:
        """What every task of this job runs its rank with, once the job's contract is known."""
        return self.tasks.task_spec(job)

    def _watch(self, monitor: JobMonitor) -> None:
        try:
            self.values = self.driver.judge(monitor)
            self.tasks.release()
        except BaseException as e:  # the job's error travels to the client in the outcome
            self._error = e
            self.driver.stop()

    def finish(self) -> Outcome:
        """Wait for the monitor (it bounds every wait of its own), close the services; return the outcome."""
        assert self._monitor_thread is not None
        while self._monitor_thread.is_alive():
            self._monitor_thread.join(1.0)
        self.driver.close()
        resets = self.elasticity.resets if self.elasticity is not None else 0
        return Outcome(values=None if self._error else list(self.values), error=_pickled(self._error),
                       rank0_stdout=list(self.rank0_stdout.lines), logs=self.relay.close(),
                       dropped=self.relay.dropped, link=self.relay.link_error, resets=resets)


def _bind_host(advertise: str) -> str:
    """Listen on the address Spark gives this executor when it is one of this machine's, else everywhere
    (a name or a NAT-ed address); the channel and the store authenticate every peer either way."""
    try:
        with socket.create_server((advertise, 0)):
            return advertise
    except OSError:
        return "0.0.0.0"


def _pickled(error: BaseException | None) -> bytes | None:
    if error is None:
        return None
    try:
        return pickle.dumps(error)
    except Exception as e:  # an error that does not pickle still reaches the client, as text
        fallback = SparkJobError(f"{type(error).__name__}: {error} (not picklable: {e})")
        return pickle.dumps(fallback)

