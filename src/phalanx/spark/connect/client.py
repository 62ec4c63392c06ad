"""The client side of a job on a Spark Connect session.

A Connect client has no SparkContext and may be unreachable from the executors, so the job is one
``mapInArrow(task, SCHEMA, barrier=True)`` query over ``np`` one-row partitions whose rank 0 task hosts
the job (:mod:`phalanx.spark.connect.task`). The client opens an authenticated log link; rank 0's task
tries it for :data:`LINK_PROBE_S` seconds: reached, the logs stream live as in a classic job; not, they
return at the end with the outcome. Results and errors always return through the query result, so
whatever the network allows, the job ends with rank 0's value or the root-cause error, and its logs.
"""

from __future__ import annotations

import json
import logging
import pickle
import queue
import threading
import time
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import cloudpickle

from phalanx.errors import PayloadError, SlotsUnavailableError, SparkJobError
from phalanx.job.channel import Closed, Custom, DriverChannel
from phalanx.job.logs import FileSink, LogSink
from phalanx.job.records import LogLine, Stream
from phalanx.launch.core import DRAIN_WAIT_S, JobSpec, new_run_id
from phalanx.launch.elasticity import ElasticSpec
from phalanx.spark.connect import wire as connect_wire
from phalanx.spark.connect.session import StageWatch, check_slots, client_bind_host, client_host
from phalanx.spark.connect.task import ConnectTaskSpec, connect_task
from phalanx.spark.driver_log import rank_log_dir
from phalanx.spark.launcher import Rank0Stdout, StreamSink

if TYPE_CHECKING:
    from pyspark.sql import DataFrame
    from pyspark.sql.connect.session import SparkSession as ConnectSession

log = logging.getLogger("phalanx")

#: Seconds rank 0's task tries to reach the client's log link before it keeps the logs for the end.
LINK_PROBE_S = 3.0
_SPARK_ERROR_LINES = 30
_STREAMS = {"stdout": Stream.STDOUT, "stderr": Stream.STDERR}
#: Put on the log link's queue when the query returned, so the pump stops waiting for records at once.
_QUERY_ENDED = object()


@dataclass
class _Sinks:
    """Where the client writes log records, as the classic launcher does for its console setting."""

    console: StreamSink
    files: FileSink | None

    def write(self, record: connect_wire.LogRecord) -> None:
        rank, kind, text = record
        line = LogLine(rank=int(rank), stream=_STREAMS.get(kind, Stream.STDOUT), text=str(text))
        targets: list[LogSink] = [self.files] if self.files is not None else []
        if kind == "message" or self.files is None:
            targets.append(self.console)
        for sink in targets:
            sink.write(line)

    def flush(self) -> None:
        for sink in (self.console, self.files):
            if sink is not None:
                sink.flush()


class ConnectLauncher:
    """Runs one job on a Spark Connect session; use :meth:`run` once.

    Has the attributes the entry points read from a classic launcher: ``values``, ``rank0_stdout``,
    ``log_dir``, ``spark_error`` and ``resets``.

    Args:
        spec: the job.
        session: the Spark Connect ``SparkSession``.
        elastic: the elastic policy, or None for a plain job.
    """

    def __init__(self, spec: JobSpec, session: ConnectSession, elastic: ElasticSpec | None = None) -> None:
        self.spec = spec
        self.session = session
        self.elastic = elastic
        self.run_id = new_run_id()
        self.values: list[object] = []
        self.rank0_stdout = Rank0Stdout()
        self.log_dir: str | None = None
        self.spark_error: SparkJobError | None = None
        self.resets = 0
        self._collected: connect_wire.Collected | None = None
        self._failure: BaseException | None = None
        self._live = False
        self._link_closed = False
        self._secret = ""
        self._query_ended = threading.Event()

    def run(self) -> list[object]:
        """Run the job to its end; return each rank's value (None for a command job) in rank order.

        Raises:
            SlotsUnavailableError: the session's settings say the cluster cannot run ``np`` tasks at once.
            WorkerFailedError, StartTimeoutError: as for a classic job (root cause first).
            SparkJobError: Spark failed the query (a task or executor died, or Spark refused the stage).
        """
        check_slots(self.session, self.spec.np, self.spec.ranks_per_task)
        sinks = self._sinks()
        advertise = client_host(self.session)
        link = DriverChannel(1, b"", bind_host=client_bind_host(self.session, advertise), advertise_host=advertise)
        self._secret = link.secret  # authenticates the log link and signs the outcome
        tag = f"phalanx-{self.run_id}"
        try:
            query = self._query(link)
            log.info("phalanx: Spark Connect session: job %s runs its rendezvous in rank 0's task; its logs stream "
                     "live if the executors reach this client at %s within %g s, else they return with the "
                     "result", self.run_id, link.address, LINK_PROBE_S)
            with StageWatch(self.session) as watch:
                thread = threading.Thread(target=self._collect, args=(query, tag, watch, link),
                                          name="phalanx-connect", daemon=True)
                thread.start()
                self._pump(link, sinks, thread, tag, watch)
            outcome = self._outcome()
            if not outcome.link:  # streamed to the end: the task closed the link before returning; read it out
                while not self._link_closed and self._read_link(link, sinks, DRAIN_WAIT_S):
                    pass
            return self._finish(outcome, sinks)
        finally:
            link.close()
            if sinks.files is not None:
                sinks.files.close()

    def _sinks(self) -> _Sinks:
        console = StreamSink(self.spec.stdout, self.spec.stderr)
        if self.spec.console == "all":
            return _Sinks(console, None)
        self.log_dir = rank_log_dir(self.run_id)
        return _Sinks(console, FileSink(self.log_dir))

    def _query(self, link: DriverChannel) -> DataFrame:
        spec = ConnectTaskSpec(job=replace(self.spec, stdout=None, stderr=None), run_id=self.run_id,
                               elastic=self.elastic, client=link.address, secret=link.secret, probe_s=LINK_PROBE_S)
        tasks = self.spec.tasks
        return self.session.range(0, tasks, 1, tasks).mapInArrow(connect_task(spec), connect_wire.SCHEMA, barrier=True)

    def _collect(self, query: DataFrame, tag: str, watch: StageWatch, link: DriverChannel) -> None:
        watch.thread_id = threading.get_ident()
        self.session.addTag(tag)  # tags are the thread's: this query only
        try:
            self._collected = connect_wire.assemble(query.collect())
        except BaseException as e:  # reported by the caller's thread
            self._failure = e
        finally:
            self.session.removeTag(tag)
            self._query_ended.set()
            try:
                link.events.put(_QUERY_ENDED, block=False)  # wakes the pump
            except queue.Full:
                pass  # the pump has records to read, and sees the end after them

    def _pump(self, link: DriverChannel, sinks: _Sinks, thread: threading.Thread, tag: str, watch: StageWatch) -> None:
        """Write live log records until the query ended and the link (if any) is read out; give up on a stage
        that has not started within the start timeout (too few free slots: Spark retries its check for minutes).

        Raises:
            SlotsUnavailableError: the stage did not start in time (the query is interrupted).
        """
        deadline = time.monotonic() + self.spec.start_timeout_s
        try:
            while thread.is_alive() and not self._query_ended.is_set():
                self._read_link(link, sinks, 0.1)
                waiting = watch.armed and not watch.started.is_set() and not self._live
                if waiting and time.monotonic() > deadline and thread.is_alive():
                    raise self._not_started()
        except BaseException:
            self.session.interruptTag(tag)  # Ctrl-C: Spark kills the tasks, their workers die with them
            thread.join(DRAIN_WAIT_S)
            raise

    def _read_link(self, link: DriverChannel, sinks: _Sinks, timeout: float) -> bool:
        """Handle one event of the log link; False when it closed or nothing came within ``timeout``."""
        try:
            event = link.events.get(timeout=timeout)
        except queue.Empty:
            return False
        if isinstance(event, Closed):  # the link's records all came before it
            self._link_closed = True
            return False
        if isinstance(event, Custom):
            if not self._live:
                self._live = True
                log.info("phalanx: logs stream live: rank 0's task reached this client at %s", link.address)
            for record in json.loads(event.body).get("logs", []):
                sinks.write(tuple(record))
            sinks.flush()
        return True

    def _not_started(self) -> SlotsUnavailableError:
        np, tasks, timeout = self.spec.np, self.spec.tasks, self.spec.start_timeout_s
        return SlotsUnavailableError(
            f"the barrier stage of job {self.run_id} ({tasks} tasks) did not start within {timeout:g} s: Spark "
            f"starts it only when all {tasks} tasks get a task slot at once, and it keeps retrying that check "
            "(spark.scheduler.barrier.maxConcurrentTasksCheck.*), so the cluster has fewer free task slots than "
            f"the job's {tasks} tasks (np={np}). Lower np/num_processes/num_proc, give the cluster more executors, "
            f"cores or GPUs, or raise {self.spec.start_timeout_hint}")

    def _outcome(self) -> connect_wire.Outcome:
        """Rank 0's outcome, checked; or the error of Spark failing the query."""
        if self._failure is not None:
            raise self._spark_failed(self._failure)
        assert self._collected is not None
        if self._collected.outcome is None:
            raise self._spark_failed(SparkJobError(_status_errors(self._collected.statuses) or "no outcome"))
        return connect_wire.verify(self._collected.outcome, self._secret)

    def _finish(self, outcome: connect_wire.Outcome, sinks: _Sinks) -> list[object]:
        assert self._collected is not None
        self._show_logs(outcome, sinks)
        self.resets = outcome.resets
        self.rank0_stdout.lines = list(outcome.rank0_stdout)
        if outcome.error is not None:
            error = pickle.loads(outcome.error)
            notes = _status_errors(self._collected.statuses)
            if notes and hasattr(error, "add_note"):
                error.add_note(notes)
            raise error
        self.values = [_load(rank, raw) for rank, raw in enumerate(outcome.values or [])]
        return self.values

    def _show_logs(self, outcome: connect_wire.Outcome, sinks: _Sinks) -> None:
        if outcome.link and (outcome.logs or outcome.dropped):
            log.info("phalanx: logs returned with the result: %s", outcome.link)
        for record in outcome.logs:
            sinks.write(record)
        if outcome.dropped:
            log.warning("phalanx: %d log record(s) of job %s were dropped: more than the return budget, and the "
                        "client was not reachable to stream them", outcome.dropped, self.run_id)
        sinks.flush()

    def _spark_failed(self, error: BaseException) -> BaseException:
        if isinstance(error, SparkJobError):
            self.spark_error = error
            return error
        if not isinstance(error, Exception):
            return error
        lines = str(error).strip().splitlines()
        message = "\n".join(lines[:_SPARK_ERROR_LINES]) + ("\n..." if len(lines) > _SPARK_ERROR_LINES else "")
        self.spark_error = SparkJobError(
            f"Spark failed the barrier query of job {self.run_id} (a task or its executor died, or Spark refused "
            f"the stage): {type(error).__name__}: {message}")
        self.spark_error.__cause__ = error
        return self.spark_error


def _status_errors(statuses: list[connect_wire.TaskStatus]) -> str:
    errors = [f"rank {s['rank']}: {s['error']}" for s in statuses if s.get("error")]
    return "; ".join(errors)


def _load(rank: int, raw: bytes | None) -> object:
    if raw is None:
        return None
    try:
        return cloudpickle.loads(raw)
    except Exception as e:
        raise PayloadError(
            f"rank {rank}'s return value cannot be unpickled on the client: {type(e).__name__}: {e}. "
            "Return plain Python objects or tensors; types defined only on the workers cannot be loaded."
        ) from e
