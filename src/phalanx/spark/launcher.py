"""The driver side of a Spark job: one barrier stage whose tasks start and supervise the ranks.

The driver hosts the job's channel and its rendezvous store (as the local launcher does), both
listening on the address Spark binds the driver to (``spark.driver.bindAddress``, by default
``spark.driver.host``, never every interface) and advertised at ``spark.driver.host``: executors must
reach the driver anyway, the store's port is bound before any task starts (no free-port race on an executor), and the
store outlives every rank. The barrier stage runs in a background thread under its own job group while
the :class:`~phalanx.job.monitor.JobMonitor` runs in the caller's thread. On the first failure the
driver sends ABORT to every task (each stops its worker's process tree), then cancels the job group.
"""

from __future__ import annotations

import json
import logging
import threading
from dataclasses import dataclass, field
from typing import IO, TYPE_CHECKING, Any

from phalanx.env import JobContract
from phalanx.env.contract import teardown_grace_s
from phalanx.errors import SparkJobError
from phalanx.job.channel import Custom, DriverChannel, Role
from phalanx.job.logs import FileSink, LineJoiner, LogSink
from phalanx.job.monitor import JobMonitor, MonitorConfig
from phalanx.job.progress import Progress
from phalanx.job.records import ErrorRecord, LogLine, Stream
from phalanx.launch.core import monitor_config, new_run_id
from phalanx.launch.rendezvous import RendezvousStore
from phalanx.launch.supervisor import ExitReports
from phalanx.observe import ObserveOptions, open_watch
from phalanx.observe import resolve as resolve_observe
from phalanx.spark.driver_log import rank_log_dir
from phalanx.spark.session import bind_address, driver_host, executor_python, python_exec
from phalanx.spark.task import TaskSpec, barrier_task

if TYPE_CHECKING:
    from pyspark import SparkContext

log = logging.getLogger(__name__)

#: Seconds the driver waits for the barrier stage to end once the job is over, before cancelling it.
STAGE_END_WAIT_S = 30.0
_SPARK_ERROR_LINES = 30


@dataclass(frozen=True)
class SparkJobSpec:
    """One Spark job, validated by the public entry points.

    Attributes:
        np: number of ranks (barrier tasks).
        payload: the serialized call (function jobs); empty for a command job.
        command: ``(script, *args)`` run with the executor's python on every rank; None for functions.
        env: the user's extra variables for every rank.
        start_timeout_s: seconds every rank has to start.
        start_timeout_hint: the argument that raises the start timeout.
        use_gpu: give each rank its task's GPUs.
        console: ``"all"`` prints every rank's output on the driver; ``"log_callback_only"`` prints only
            ``log_to_driver`` messages and keeps the full logs in files.
        progress: tell on ``stderr`` what the start waits for (the barrier tasks, the ranks started).
        stdout: where rank output goes on the driver (default: ``sys.stdout`` at the time of writing).
        stderr: where rank error output goes on the driver (default: ``sys.stderr``).
        description: shown in the Spark UI.
        teardown_grace_s: seconds between SIGTERM and SIGKILL when the job is aborted.
        warm_preload: modules for the executors' warm-start templates (function jobs); None: cold.
        ranks_per_task: ranks each barrier task runs, one per GPU of the task (``spark.task.resource.gpu.amount``
            when it is above 1); ``np`` is a multiple of it (:func:`phalanx.spark.gpus.ranks_per_task`).
        observe: the job's live page and MLflow logging on the driver (default: ``PHALANX_DASHBOARD`` /
            ``PHALANX_MLFLOW``, so ``HorovodRunner`` and ``TorchDistributor`` honour them; docs/observe.md).
    """

    np: int
    payload: bytes = b""
    command: tuple[str, ...] | None = None
    env: dict[str, str] = field(default_factory=dict)
    start_timeout_s: float = 30.0
    start_timeout_hint: str = "start_timeout"
    use_gpu: bool = False
    console: str = "all"
    progress: bool = True
    stdout: IO[str] | None = None
    stderr: IO[str] | None = None
    description: str = "phalanx job"
    teardown_grace_s: float = field(default_factory=teardown_grace_s)
    warm_preload: tuple[str, ...] | None = None
    ranks_per_task: int = 1
    observe: ObserveOptions | None = field(default_factory=resolve_observe)

    @property
    def tasks(self) -> int:
        """Barrier tasks of the job (``np / ranks_per_task``)."""
        return self.np // self.ranks_per_task


class StreamSink:
    """Writes ``[rank]<stream>:text`` lines to given streams (or sys.stdout/sys.stderr when None)."""

    def __init__(self, stdout: IO[str] | None, stderr: IO[str] | None) -> None:
        self._out = stdout
        self._err = stderr
        self._joiner = LineJoiner()

    def _stream(self, stream: Stream) -> IO[str]:
        import sys

        if stream is Stream.STDOUT:
            return self._out or sys.stdout
        return self._err or sys.stderr

    def write(self, line: LogLine) -> None:
        """Write one line, prefixed with its rank and stream."""
        self._stream(line.stream).write(self._joiner.piece(line, f"[{line.rank}]<{line.stream.label}>:"))

    def flush(self) -> None:
        """Flush both streams."""
        for stream in (Stream.STDOUT, Stream.STDERR):
            self._stream(stream).flush()


class Rank0Stdout:
    """Keeps rank 0's stdout lines (a script job returns them)."""

    def __init__(self) -> None:
        self.lines: list[str] = []
        self._open = False  # the last line came in pieces and goes on

    def write(self, line: LogLine) -> None:
        """Keep the line when it is rank 0's stdout (the pieces of a long line make one)."""
        if line.rank == 0 and line.stream is Stream.STDOUT:
            if self._open and self.lines:
                self.lines[-1] += line.text
            else:
                self.lines.append(line.text)
            self._open = line.more

    def flush(self) -> None:
        """Nothing to flush."""


class SparkLauncher:
    """Runs one job as a barrier stage; use :meth:`run` once.

    Args:
        spec: the job.
        sc: the SparkContext to run on.
    """

    def __init__(self, spec: SparkJobSpec, sc: SparkContext) -> None:
        self.spec = spec
        self.sc = sc
        self.run_id = new_run_id()
        self.rank0_stdout = Rank0Stdout()
        self.log_dir: str | None = None
        self.values: list[Any] = []
        #: Set when Spark itself failed the stage (then the job's error is this, not a rank's).
        self.spark_error: SparkJobError | None = None
        self._console = StreamSink(spec.stdout, spec.stderr)
        self.progress = Progress(enabled=spec.progress, stream=spec.stderr)
        self._tasks_started = 0
        self._files: FileSink | None = None
        self._exits = ExitReports(spec.command is None)
        self._stopping = threading.Event()
        self._job_thread: threading.Thread | None = None
        self._channel: DriverChannel | None = None

    def run(self) -> list[Any]:
        """Run the job to its end; return each rank's value (None for a command job) in rank order.

        Raises:
            WorkerFailedError: a rank failed (root cause first).
            StartTimeoutError: ranks did not start in time.
            SparkJobError: Spark failed the stage for a reason outside the user's code.
        """
        watch = open_watch(self.spec.observe, self.run_id, self.spec.np, "Spark job")
        host, bind = driver_host(self.sc), bind_address(self.sc)
        channel = DriverChannel(self._channel_size(), self.spec.payload, bind_host=bind, advertise_host=host)
        store = RendezvousStore(self._channel_size(), channel.secret, bind_host=bind)
        self._channel = channel
        self._exits.attach(channel)
        job = JobContract(run_id=self.run_id, master_addr=host, master_port=store.port,
                          channel=channel.address, secret=channel.secret,
                          start_timeout_s=self.spec.start_timeout_s)
        monitor = self._monitor(channel, self._sinks())
        monitor.observer = watch.observe if watch is not None else None
        try:
            self._prepare(store)
            self.progress.step(f"waiting for {self.spec.tasks} barrier task(s) of Spark to start the ranks")
            self._submit(job)
            self.values = monitor.run()
            self._succeeded()
            return self.values
        except BaseException:
            self._stop_all()  # Ctrl-C, or an error of our own: stop the ranks now, not after a wait
            raise
        finally:
            channel.events.close()  # the job is judged: nobody reads the events any more
            self._finish()
            channel.close()
            store.close()
            if self._files is not None:
                self._files.close()
            if watch is not None:
                watch.close()

    def _channel_size(self) -> int:
        """How many worker ids the channel and the store accept (an elastic job needs more than np)."""
        return self.spec.np

    def _monitor(self, channel: DriverChannel, sinks: list[LogSink]) -> JobMonitor:
        return JobMonitor(self._monitor_config(), channel.events, sinks, stop_all=self._stop_all,
                          on_custom=self._on_custom, progress=self.progress,
                          on_tick=lambda: self._count_tasks(channel))

    def _count_tasks(self, channel: DriverChannel) -> None:
        """Say how many barrier tasks started: a task has started once one of its ranks (or its supervisor)
        reached the channel."""
        if not self.progress.enabled or self._tasks_started >= self.spec.tasks:
            return
        started = {rank // self.spec.ranks_per_task for rank in range(self.spec.np) if channel.ever_connected(rank)}
        if len(started) > self._tasks_started:
            self._tasks_started = len(started)
            self.progress.count("barrier tasks started", len(started), self.spec.tasks)

    def _prepare(self, store: RendezvousStore) -> None:
        """Called before the stage is submitted (an elastic job publishes its first round)."""

    def _succeeded(self) -> None:
        """Called once the monitor returned the job's values."""

    def _task_spec(self, job: JobContract) -> TaskSpec:
        observed = self.spec.observe.rank_env() if self.spec.observe is not None else {}
        return TaskSpec(job=job, command=self.spec.command, env={**observed, **self.spec.env},
                        use_gpu=self.spec.use_gpu, teardown_grace_s=self.spec.teardown_grace_s,
                        warm_preload=self.spec.warm_preload, ranks_per_task=self.spec.ranks_per_task)

    def _unfinished(self) -> list[int]:
        """The ranks (worker ids) still expected to end, when Spark failed the stage."""
        with self._exits.lock:
            return [r for r in range(self.spec.np) if r not in self._exits.exited]

    def _monitor_config(self) -> MonitorConfig:
        return monitor_config(self.spec.np, self.spec.command is None, self.spec.start_timeout_s,
                              self.spec.start_timeout_hint, self.spec.teardown_grace_s)

    def _sinks(self) -> list[LogSink]:
        sinks: list[LogSink] = [self.rank0_stdout]
        if self.spec.console == "all":
            sinks.append(self._console)
        else:
            self.log_dir = rank_log_dir(self.run_id)
            self._files = FileSink(self.log_dir)
            sinks.append(self._files)
        return sinks

    def _submit(self, job: JobContract) -> None:
        spec = self._task_spec(job)
        with python_exec(self.sc, executor_python(self.sc)):
            tasks = self.spec.tasks
            rdd = self.sc.parallelize(range(tasks), tasks).barrier().mapPartitions(barrier_task(spec))
            rdd._jrdd  # noqa: B018 - builds the Python function now, while pythonExec is the right one
        self._job_thread = threading.Thread(target=self._collect, args=(rdd,), name="phalanx-spark-job",
                                            daemon=True)
        self._job_thread.start()

    def _collect(self, rdd: Any) -> None:
        try:
            self.sc.setJobGroup(self.run_id, self.spec.description, interruptOnCancel=True)
            statuses = [json.loads(s) for s in rdd.collect()]
        except Exception as e:
            self._spark_failed(e)
            return
        for status in statuses:
            if not status["reported"]:
                self._exits.post(int(status["rank"]), int(status["exit"]), status.get("error") or "")

    def _spark_failed(self, error: Exception) -> None:
        """Spark ended the stage with an error: a lost task or executor, unless phalanx cancelled it itself.

        The ranks that had not reported are failed with a :class:`SparkJobError` carrying Spark's own
        words (the lost executor, its host and exit code), even when phalanx was already stopping the job
        because a survivor noticed the loss first; each one failed when its first connection closed (its
        process or its task died; a lost executor's task may outlive its rank's process by seconds), so
        the lost rank, not the survivor, is the root cause.
        """
        if self._stopping.is_set() and "cancel" in str(error).lower():
            return
        missing = self._unfinished()
        if not missing:
            return
        lines = str(error).strip().splitlines()
        message = "\n".join(lines[:_SPARK_ERROR_LINES]) + ("\n..." if len(lines) > _SPARK_ERROR_LINES else "")
        channel = self._channel
        assert channel is not None
        lost = sorted(missing, key=lambda r: _gone_at(channel, r) or float("inf"))
        where = ", ".join(f"rank {r} on host {channel.host_of(r) or '(not known: it never started)'}" for r in lost)
        self.spark_error = SparkJobError(
            f"Spark failed the barrier stage of job {self.run_id} before rank(s) {missing} finished (a task "
            f"or its executor died, or Spark refused the stage; first to go: {where}): {message}"
        )
        channel.events.put(ErrorRecord.from_exception(lost[0], self.spark_error))
        for rank in lost:
            self._exits.post(rank, 1, ended_at=_gone_at(channel, rank))

    def _on_custom(self, event: Custom) -> None:
        try:
            body = json.loads(event.body)
        except ValueError:
            return
        if "log" in body:
            line = LogLine(rank=event.rank, stream=Stream.STDOUT, text=str(body["log"]))
            for sink in (self._console, self._files):
                if sink is not None:
                    sink.write(line)
        else:
            self._exits.on_event(event)

    def _stop_all(self) -> None:
        if self._stopping.is_set():
            return
        self._stopping.set()
        if self._channel is not None:
            self._channel.abort_all()
        threading.Thread(target=self._cancel_after_grace, name="phalanx-cancel", daemon=True).start()

    def _cancel_after_grace(self) -> None:
        # Tasks stop their workers on ABORT and end on their own; a stage still running is cancelled.
        thread = self._job_thread
        if thread is not None:
            thread.join(self.spec.teardown_grace_s + 2.0)
            if thread.is_alive():
                log.debug("cancelling Spark job group %s", self.run_id)
                self.sc.cancelJobGroup(self.run_id)

    def _finish(self) -> None:
        thread = self._job_thread
        if thread is None:
            return
        thread.join(STAGE_END_WAIT_S if not self._stopping.is_set() else 0.0)
        if thread.is_alive():
            self._stop_all()
            thread.join(self.spec.teardown_grace_s + STAGE_END_WAIT_S)
        if thread.is_alive():
            log.warning("phalanx: the barrier stage of job %s did not end within %.0f s of its cancellation",
                        self.run_id, STAGE_END_WAIT_S)


def _gone_at(channel: DriverChannel, rank: int) -> float | None:
    """When the first of a rank's connections, its process's or its task's, closed (None: both open)."""
    times = [t for role in (Role.WORKER, Role.SUPERVISOR) if (t := channel.closed_at(rank, role)) is not None]
    return min(times, default=None)
