"""The driver side of a Spark job: one barrier stage whose tasks start and supervise the ranks.

The driver hosts the job's channel and its rendezvous store (as the local launcher does), both
listening on the address Spark binds the driver to (``spark.driver.bindAddress``, by default
``spark.driver.host``, never every interface) and advertised at ``spark.driver.host``: executors must
reach the driver anyway, the store's port is bound before any task starts (no free-port race on an executor), and the
store outlives every rank. The barrier stage runs in a background thread under its own job group while
the :class:`~phalanx.job.monitor.JobMonitor` runs in the caller's thread. On the first failure the
driver sends ABORT to every task (each stops its worker's process tree), then cancels the job group.

The launcher is the one :class:`~phalanx.launch.driver.JobDriver` with a :class:`SparkBarrierStage` as its
rank starter and, for an elastic job, an :class:`~phalanx.launch.elasticity.Elasticity` whose replacements go
to the slots of :class:`BarrierTasks`.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable
from dataclasses import replace
from typing import IO, TYPE_CHECKING

from phalanx.env import JobContract
from phalanx.errors import SparkJobError
from phalanx.job.channel import Custom, DriverChannel, Role
from phalanx.job.logs import FileSink, LineJoiner, LogSink
from phalanx.job.progress import Progress
from phalanx.job.records import ErrorRecord, LogLine, Stream
from phalanx.launch.core import JobSpec, new_run_id
from phalanx.launch.driver import DriverAddress, JobDriver
from phalanx.launch.elasticity import Elasticity, ElasticSpec, worker_id_budget
from phalanx.launch.supervisor import ExitReports
from phalanx.spark.driver_log import rank_log_dir
from phalanx.spark.session import bind_address, driver_host, executor_python, python_exec
from phalanx.spark.task import TaskSpec, barrier_task

if TYPE_CHECKING:
    from pyspark import RDD, SparkContext

log = logging.getLogger(__name__)

#: Seconds the driver waits for the barrier stage to end once the job is over, before cancelling it.
STAGE_END_WAIT_S = 30.0
_SPARK_ERROR_LINES = 30


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


def task_spec(spec: JobSpec, job: JobContract, elastic: ElasticSpec | None) -> TaskSpec:
    """What every barrier task of ``spec`` runs its ranks with, once the job's contract is known."""
    observed = spec.observe.rank_env() if spec.observe is not None else {}
    base = TaskSpec(job=job, command=spec.command, env={**observed, **spec.env}, use_gpu=spec.use_gpu,
                    teardown_grace_s=spec.teardown_grace_s, warm_preload=spec.warm_preload,
                    ranks_per_task=spec.ranks_per_task)
    if elastic is None:
        return base
    return replace(base, elastic_timeout_s=elastic.timeout_s, worker_ids=slot_budget(spec.np, elastic))


def slot_budget(np: int, elastic: ElasticSpec) -> int:
    """The worker ids of an elastic Spark job of ``np`` slots."""
    return worker_id_budget(np, elastic.policy.reset_limit)


class BarrierTasks:
    """What a driver knows of its barrier stage's tasks, wherever it runs (Spark's driver, or rank 0's task of
    a Connect job): their exit reports and EVENT frames, and, for an elastic job, the slots their workers run
    in (a :class:`~phalanx.launch.elasticity.Replacer`: a worker that dies while its task lives is replaced in
    its slot, by a ``{"spawn": worker_id}`` command to the task).

    Args:
        spec: the job (``np`` slots).
        elastic: the policy, or None for a plain job.
        messages: where ``log_to_driver`` messages go (rank, text).
    """

    def __init__(self, spec: JobSpec, elastic: ElasticSpec | None, messages: Callable[[int, str], None]) -> None:
        self.spec = spec
        self.elastic = elastic
        self.exits = ExitReports(spec.command is None)
        #: The slot (barrier task) of every worker id started so far.
        self.slot_of: list[int] = list(range(spec.np))
        #: Set when Spark itself failed the stage (then the job's error is this, not a rank's).
        self.spark_error: SparkJobError | None = None
        self.channel: DriverChannel | None = None
        self._messages = messages
        self._aborted = threading.Event()

    def attach(self, channel: DriverChannel) -> None:
        """The job's channel, before any task reports."""
        self.channel = channel
        self.exits.attach(channel)

    def task_spec(self, job: JobContract) -> TaskSpec:
        """See :func:`task_spec`."""
        return task_spec(self.spec, job, self.elastic)

    def on_custom(self, event: Custom) -> None:
        """A task's EVENT frame: a ``log_to_driver`` message, or its rank's exit report."""
        try:
            body = json.loads(event.body)
        except ValueError:
            return
        if isinstance(body, dict) and "log" in body:
            self._messages(event.rank, str(body["log"]))
        else:
            self.exits.on_event(event)

    def abort(self) -> bool:
        """Send ABORT to every task (each stops its worker's process tree); False when it was sent already."""
        if self._aborted.is_set():
            return False
        self._aborted.set()
        if self.channel is not None:
            self.channel.abort_all()
        return True

    def release(self) -> None:
        """The job succeeded: tasks whose worker was lost and not replaced wait for a command; end them."""
        if self.elastic is not None and self.channel is not None:
            self.channel.abort_all()

    def unfinished(self) -> list[int]:
        """The workers whose end was not posted."""
        with self.exits.lock:
            return [w for w in range(len(self.slot_of)) if w not in self.exits.exited]

    def add(self, kept: list[int], count: int) -> list[int]:
        """Start up to ``count`` replacements, each in a slot whose worker is gone (not one of ``kept``)."""
        busy = {self.slot_of[w] for w in kept}
        added: list[int] = []
        budget = slot_budget(self.spec.np, self.elastic) if self.elastic is not None else self.spec.np
        for slot in [s for s in range(self.spec.np) if s not in busy][:count]:
            worker = len(self.slot_of)
            if worker >= budget:
                log.warning("elastic job used all %d worker ids; slot %d stays empty", worker, slot)
                break
            assert self.channel is not None
            if self.channel.command(slot, Role.SUPERVISOR, json.dumps({"spawn": worker}).encode()):
                self.slot_of.append(slot)
                added.append(worker)
            else:
                log.warning("the task of slot %d is gone; it cannot host a replacement", slot)
        log.info("elastic replacements %s in slots %s", added, [self.slot_of[w] for w in added])
        return added

    def free_slots(self, alive: list[int]) -> int:
        """The slots whose worker is gone (none once Spark failed the stage)."""
        if self.spark_error is not None:
            return 0
        return self.spec.np - len({self.slot_of[w] for w in alive})

    def give_up(self) -> str:
        """Spark failed the stage: no slot can host a replacement."""
        if self.spark_error is None:
            return ""
        return "Spark failed the barrier stage (a lost executor or task), so no slot can host a replacement"

    def leaving(self) -> set[int]:
        """None: a task does not leave on its own."""
        return set()


class SparkBarrierStage:
    """The ranks as children of a barrier stage's tasks (a :class:`~phalanx.launch.driver.RankStarter`): the
    stage is submitted in a background thread under its own job group; stopping sends ABORT to every task,
    then cancels the job group if the stage still runs after the grace.

    Args:
        sc: the SparkContext.
        run_id: the job's id (its Spark job group).
        tasks: the stage's tasks, as the driver sees them.
        progress: tells what the start waits for.
    """

    def __init__(self, sc: SparkContext, run_id: str, tasks: BarrierTasks, progress: Progress) -> None:
        self.sc = sc
        self.spec = tasks.spec
        self.run_id = run_id
        self.tasks = tasks
        self.progress = progress
        self._stopping = threading.Event()
        self._job_thread: threading.Thread | None = None
        self._tasks_started = 0

    def count_tasks(self) -> None:
        """Say how many barrier tasks started: a task has started once one of its ranks (or its supervisor)
        reached the channel (the monitor calls this at every poll and before a rank's start is counted)."""
        channel = self.tasks.channel
        if channel is None or not self.progress.enabled or self._tasks_started >= self.spec.tasks:
            return
        per_task = self.spec.ranks_per_task
        started = {rank // per_task for rank in range(self.spec.np) if channel.ever_connected(rank)}
        if len(started) > self._tasks_started:
            self._tasks_started = len(started)
            self.progress.count("barrier tasks started", len(started), self.spec.tasks)

    def start(self, job: JobContract, channel: DriverChannel) -> None:
        """Submit the stage: one barrier task per ``ranks_per_task`` ranks."""
        self.tasks.attach(channel)
        self.progress.step(f"waiting for {self.spec.tasks} barrier task(s) of Spark to start the ranks")
        spec = self.tasks.task_spec(job)
        with python_exec(self.sc, executor_python(self.sc)):
            tasks = self.spec.tasks
            rdd = self.sc.parallelize(range(tasks), tasks).barrier().mapPartitions(barrier_task(spec))
            rdd._jrdd  # noqa: B018 - builds the Python function now, while pythonExec is the right one
        self._job_thread = threading.Thread(target=self._collect, args=(rdd,), name="phalanx-spark-job",
                                            daemon=True)
        self._job_thread.start()

    def stop(self, grace_s: float) -> None:
        """ABORT every task (each stops its ranks' process trees, SIGTERM then SIGKILL after the tasks' own
        teardown grace); cancel the stage if it still runs ``grace_s`` later."""
        if self._stopping.is_set():
            return
        self._stopping.set()
        self.tasks.abort()
        threading.Thread(target=self._cancel_after_grace, args=(grace_s,), name="phalanx-cancel", daemon=True).start()

    def unfinished(self) -> list[int]:
        """See :meth:`BarrierTasks.unfinished`."""
        return self.tasks.unfinished()

    def close(self) -> None:
        """Wait for the stage to end (cancelled if it does not within :data:`STAGE_END_WAIT_S`)."""
        if not self._stopping.is_set():
            self.tasks.release()
        thread = self._job_thread
        if thread is None:
            return
        thread.join(STAGE_END_WAIT_S if not self._stopping.is_set() else 0.0)
        if thread.is_alive():
            self.stop(self.spec.teardown_grace_s)
            thread.join(self.spec.teardown_grace_s + STAGE_END_WAIT_S)
        if thread.is_alive():
            log.warning("phalanx: the barrier stage of job %s did not end within %.0f s of its cancellation",
                        self.run_id, STAGE_END_WAIT_S)

    def _cancel_after_grace(self, grace_s: float) -> None:
        # Tasks stop their workers on ABORT and end on their own; a stage still running is cancelled.
        thread = self._job_thread
        if thread is not None:
            thread.join(grace_s + 2.0)
            if thread.is_alive():
                log.debug("cancelling Spark job group %s", self.run_id)
                self.sc.cancelJobGroup(self.run_id)

    def _collect(self, rdd: RDD[str]) -> None:
        try:
            self.sc.setJobGroup(self.run_id, self.spec.description, interruptOnCancel=True)
            statuses = [json.loads(s) for s in rdd.collect()]
        except Exception as e:
            self._spark_failed(e)
            return
        for status in statuses:
            if not status["reported"]:
                self.tasks.exits.post(int(status["rank"]), int(status["exit"]), status.get("error") or "")

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
        missing = self.unfinished()
        if not missing:
            return
        lines = str(error).strip().splitlines()
        message = "\n".join(lines[:_SPARK_ERROR_LINES]) + ("\n..." if len(lines) > _SPARK_ERROR_LINES else "")
        channel = self.tasks.channel
        assert channel is not None
        lost = sorted(missing, key=lambda r: _gone_at(channel, r) or float("inf"))
        where = ", ".join(f"rank {r} on host {channel.host_of(r) or '(not known: it never started)'}" for r in lost)
        error = SparkJobError(
            f"Spark failed the barrier stage of job {self.run_id} before rank(s) {missing} finished (a task "
            f"or its executor died, or Spark refused the stage; first to go: {where}): {message}"
        )
        self.tasks.spark_error = error
        channel.events.put(ErrorRecord.from_exception(lost[0], error))
        for rank in lost:
            self.tasks.exits.post(rank, 1, ended_at=_gone_at(channel, rank))


class SparkLauncher:
    """Runs one job as a barrier stage; use :meth:`run` once.

    Args:
        spec: the job.
        sc: the SparkContext to run on.
        elastic: the elastic policy (a worker that dies while its executor lives is replaced in its slot:
            :mod:`phalanx.spark.elastic_run`), or None for a plain job.
    """

    def __init__(self, spec: JobSpec, sc: SparkContext, elastic: ElasticSpec | None = None) -> None:
        self.spec = spec
        self.sc = sc
        self.run_id = new_run_id()
        self.rank0_stdout = Rank0Stdout()
        self.log_dir: str | None = None
        self.values: list[object] = []
        self.progress = Progress(enabled=spec.progress, stream=spec.stderr)
        self._console = StreamSink(spec.stdout, spec.stderr)
        self._files: FileSink | None = None
        self.tasks = BarrierTasks(spec, elastic, self._message)
        self.stage = SparkBarrierStage(sc, self.run_id, self.tasks, self.progress)
        self.elasticity = Elasticity(elastic, self.tasks, spec.np, spec.np) if elastic is not None else None

    @property
    def spark_error(self) -> SparkJobError | None:
        """Set when Spark itself failed the stage (then the job's error is this, not a rank's)."""
        return self.tasks.spark_error

    @property
    def resets(self) -> int:
        """Re-formations so far (an elastic job)."""
        return self.elasticity.resets if self.elasticity is not None else 0

    def run(self) -> list[object]:
        """Run the job to its end; return each rank's value (None for a command job) in rank order.

        Raises:
            WorkerFailedError: a rank failed (root cause first).
            StartTimeoutError: ranks did not start in time.
            SparkJobError: Spark failed the stage for a reason outside the user's code.
        """
        address = DriverAddress(bind=bind_address(self.sc), advertise=driver_host(self.sc))
        driver = JobDriver(self.spec, self.stage, address, self._sinks(), run_id=self.run_id,
                           elasticity=self.elasticity, on_custom=self.tasks.on_custom, progress=self.progress,
                           on_tick=self.stage.count_tasks, watch_title="Spark job")
        try:
            self.values = driver.run()
            return self.values
        finally:
            if self._files is not None:
                self._files.close()

    def _sinks(self) -> list[LogSink]:
        sinks: list[LogSink] = [self.rank0_stdout]
        if self.spec.console == "all":
            sinks.append(self._console)
        else:
            self.log_dir = rank_log_dir(self.run_id)
            self._files = FileSink(self.log_dir)
            sinks.append(self._files)
        return sinks

    def _message(self, rank: int, text: str) -> None:
        line = LogLine(rank=rank, stream=Stream.STDOUT, text=text)
        for sink in (self._console, self._files):
            if sink is not None:
                sink.write(line)


def _gone_at(channel: DriverChannel, rank: int) -> float | None:
    """When the first of a rank's connections, its process's or its task's, closed (None: both open)."""
    times = [t for role in (Role.WORKER, Role.SUPERVISOR) if (t := channel.closed_at(rank, role)) is not None]
    return min(times, default=None)
