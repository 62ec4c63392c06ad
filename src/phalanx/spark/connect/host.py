"""The job's driver side, run inside rank 0's task of a Spark Connect job.

Under Spark Connect the client may be unreachable from the executors, so rank 0's task does what the
driver does in a classic job: it hosts the channel and the rendezvous store (advertised at the
executor address Spark gives the task), runs the job monitor, and ends with an
:class:`~phalanx.spark.connect.wire.Outcome`. It is the classic launcher with the Spark submission taken
out (:class:`HostedLauncher`, and :class:`HostedElasticLauncher` for elastic jobs, whose slot commands
and rounds work unchanged). Log records go through a :class:`LogRelay`: live over an authenticated link
to the client when the task reached it (probed with a short timeout), else kept for the outcome.
"""

from __future__ import annotations

import json
import logging
import pickle
import socket
import threading
from dataclasses import replace
from typing import Any

from phalanx.env import JobContract
from phalanx.errors import ChannelError, SparkJobError
from phalanx.job.channel import Custom, DriverChannel, Role, WorkerChannel
from phalanx.job.framing import Kind
from phalanx.job.logs import LogSink
from phalanx.job.monitor import MonitorConfig
from phalanx.job.records import LogLine
from phalanx.launch.elastic import ElasticSpec
from phalanx.launch.rendezvous import RendezvousStore
from phalanx.spark.connect.wire import LogRecord, Outcome
from phalanx.spark.elastic_launcher import ElasticSparkLauncher
from phalanx.spark.launcher import SparkJobSpec, SparkLauncher
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


class Hosted(SparkLauncher):
    """A :class:`SparkLauncher` whose stage is already running: the one this object runs in."""

    def __init__(self, spec: SparkJobSpec, run_id: str) -> None:
        SparkLauncher.__init__(self, spec, None)  # type: ignore[arg-type]  # no SparkContext inside a task
        self.run_id = run_id
        self.relay = LogRelay()
        self._error: BaseException | None = None
        self._monitor_thread: threading.Thread | None = None
        self._store: RendezvousStore | None = None

    def host(self, advertise: str) -> JobContract:
        """Open the channel and the store on this executor, start the monitor; return the job's contract."""
        bind = _bind_host(advertise)
        channel = DriverChannel(self._channel_size(), self.spec.payload, bind_host=bind, advertise_host=advertise)
        self._channel = channel
        self._exits.attach(channel)
        self._store = RendezvousStore(self._channel_size(), channel.secret, bind_host=bind)
        job = JobContract(run_id=self.run_id, master_addr=advertise, master_port=self._store.port,
                          channel=channel.address, secret=channel.secret, start_timeout_s=self.spec.start_timeout_s)
        monitor = self._monitor(channel, self._sinks())
        self._prepare(self._store)
        self._monitor_thread = threading.Thread(target=self._watch, args=(monitor,), name="phalanx-host", daemon=True)
        self._monitor_thread.start()
        return job

    def _watch(self, monitor: Any) -> None:
        try:
            self.values = monitor.run()
            self._succeeded()
        except BaseException as e:  # the job's error travels to the client in the outcome
            self._error = e
            self._stop_all()

    def finish(self) -> Outcome:
        """Wait for the monitor (it bounds every wait of its own), close the services; return the outcome."""
        assert self._monitor_thread is not None and self._channel is not None and self._store is not None
        while self._monitor_thread.is_alive():
            self._monitor_thread.join(1.0)
        self._channel.close()
        self._store.close()
        return Outcome(values=None if self._error else list(self.values), error=_pickled(self._error),
                       rank0_stdout=list(self.rank0_stdout.lines), logs=self.relay.close(),
                       dropped=self.relay.dropped, link=self.relay.link_error, resets=self._resets())

    def task_spec(self, job: JobContract) -> TaskSpec:
        """What every task of this job runs its rank with, once the job's contract is known."""
        return self._task_spec(job)

    def _resets(self) -> int:
        return 0

    def _monitor_config(self) -> MonitorConfig:
        return replace(super()._monitor_config(), raw_results=True)

    def _sinks(self) -> list[LogSink]:
        return [self.rank0_stdout, self.relay]

    def _on_custom(self, event: Custom) -> None:
        try:
            body = json.loads(event.body)
        except ValueError:
            return
        if isinstance(body, dict) and "log" in body:
            self.relay.message(event.rank, str(body["log"]))
        else:
            super()._on_custom(event)

    def _cancel_after_grace(self) -> None:
        """Nothing to cancel from inside the stage: tasks stop their workers on ABORT and end."""


class HostedLauncher(Hosted):
    """A plain job's driver side in rank 0's task."""


class HostedElasticLauncher(Hosted, ElasticSparkLauncher):
    """An elastic job's driver side in rank 0's task: lost workers are replaced in their slots."""

    def __init__(self, spec: SparkJobSpec, run_id: str, elastic: ElasticSpec) -> None:
        Hosted.__init__(self, spec, run_id)
        # ElasticSparkLauncher's state, set here: its __init__ wants the SparkContext a task does not have.
        self.elastic = elastic
        self.slot_of = list(range(spec.np))
        self._round = -1
        self._elastic_monitor = None

    def _resets(self) -> int:
        return self.resets


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

