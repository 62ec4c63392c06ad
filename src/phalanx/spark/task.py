"""The barrier task: runs on an executor, starts one rank's worker process and supervises it.

The task never raises for a failure of the user's code: it reports the failure on the channel and
returns a status, so Spark does not retry the whole barrier stage (a deterministic error is reported
once). The worker is a child process in its own session; it dies with the task (``PR_SET_PDEATHSIG``,
set by the worker itself), and the task stops its whole process tree when the driver aborts the job.
"""

from __future__ import annotations

import json
import os
import queue
import socket
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from typing import Any

from phalanx.env import JobContract, RankIdentity, assign_ranks, compose_env, worker_env
from phalanx.env import names as N
from phalanx.errors import ChannelError, PhalanxError
from phalanx.job.channel import Role, WorkerChannel
from phalanx.job.framing import Kind
from phalanx.job.logs import pump_lines
from phalanx.job.records import ErrorRecord, LogLine, Stream
from phalanx.launch import warm
from phalanx.launch.proctree import terminate_tree
from phalanx.launch.warm import RankProcess

#: Seconds the output pipes may stay open after the worker ended (a grandchild may hold them).
DRAIN_WAIT_S = 5.0
#: Exit code reported when the task could not start its worker.
EXIT_NOT_STARTED = 1


@dataclass(frozen=True)
class TaskSpec:
    """What every barrier task needs; pickled with the task function.

    Attributes:
        job: the job's contract (store, channel, secret, start timeout).
        command: the command a rank runs (``python script args``), or None for a function job.
        env: the user's extra variables for every rank.
        use_gpu: give each rank its task's GPUs as ``CUDA_VISIBLE_DEVICES``.
        log_to_driver: route ``log_to_driver`` messages over the channel.
        teardown_grace_s: seconds between SIGTERM and SIGKILL when the job is aborted.
        warm_preload: modules a warm-start template in this executor's python worker should import
            (function jobs); None starts every rank cold.
        elastic_timeout_s: for an elastic job (survivors kept), ``PHALANX_ELASTIC_TIMEOUT_S`` of its workers;
            None for a plain job.
        worker_ids: for an elastic job, how many worker ids the driver's channel accepts.
    """

    job: JobContract
    command: tuple[str, ...] | None = None
    env: dict[str, str] = field(default_factory=dict)
    use_gpu: bool = False
    log_to_driver: bool = True
    teardown_grace_s: float = 3.0
    warm_preload: tuple[str, ...] | None = None
    elastic_timeout_s: float | None = None
    worker_ids: int = 0

    def warm(self) -> bool:
        """True when this job's ranks may be forked from a warm-start template."""
        off = self.env.get(N.PHALANX_WARM_START) == "0"
        return self.command is None and self.warm_preload is not None and not off and warm.enabled()


def exit_event(returncode: int) -> bytes:
    """Body of the EVENT frame a task sends once its worker ended and its output was drained."""
    return json.dumps({"exit": returncode}).encode()


def task_host(environ: dict[str, str] | None = None) -> str:
    """The host this task runs on, as Spark names it: ``SPARK_LOCAL_HOSTNAME`` or ``SPARK_LOCAL_IP`` when
    the executor was given one (several workers on one machine), else the machine's hostname.

    Ranks are grouped into local ranks by this name: executors on one machine share its GPUs and NICs.
    """
    env = os.environ if environ is None else environ
    return env.get(N.SPARK_LOCAL_HOSTNAME) or env.get(N.SPARK_LOCAL_IP) or socket.gethostname()


def task_gpus(resources: dict[str, Any]) -> list[str]:
    """The GPU addresses Spark gave this task (``TaskContext.resources()["gpu"]``), maybe none."""
    return [str(a) for a in (getattr(resources.get("gpu"), "addresses", None) or [])]


def _gpu_env(spec: TaskSpec, hosts: list[str], gpus: list[list[str]], rank: int) -> dict[str, str]:
    """``CUDA_VISIBLE_DEVICES`` for a rank: the GPUs of every task on its host, in local-rank order.

    So ``cuda:LOCAL_RANK`` (``torch.cuda.set_device(hvd.local_rank())``, DDP's ``device_ids=[local_rank]``)
    is this rank's own GPU when each task has one, as under torchrun or horovodrun on a multi-GPU host.
    """
    if not spec.use_gpu:
        return {}
    if not gpus[rank]:
        raise PhalanxError(
            f"use_gpu=True but Spark gave the task of rank {rank} no GPU; set spark.executor.resource.gpu.amount "
            "and spark.task.resource.gpu.amount (with a GPU discovery script), or pass use_gpu=False"
        )
    same_host = [r for r, host in enumerate(hosts) if host == hosts[rank]]
    visible = dict.fromkeys(address for r in same_host for address in gpus[r])
    return {N.CUDA_VISIBLE_DEVICES: ",".join(visible)}


def _argv(spec: TaskSpec) -> list[str]:
    if spec.command is None:
        return [sys.executable, "-m", "phalanx.worker"]
    return [sys.executable, "-m", "phalanx.worker.exec", sys.executable, *spec.command]


def _rank_env(spec: TaskSpec, who: RankIdentity, gpu_env: dict[str, str],
              extra: dict[str, str] | None = None) -> dict[str, str]:
    own = {N.PHALANX_PARENT_PID: str(os.getpid()), **gpu_env, **(extra or {})}
    if spec.log_to_driver:
        own[N.PHALANX_LOG_TO_DRIVER] = "1"
    return compose_env(os.environ, spec.env, {**worker_env(spec.job, who), **own}, os.cpu_count())


class _Supervisor:
    """One rank's worker process and its forwarding threads."""

    def __init__(self, spec: TaskSpec, channel: WorkerChannel, rank: int,
                 aborted: threading.Event | None = None) -> None:
        self.spec = spec
        self.channel = channel
        self.rank = rank
        self.proc: RankProcess | None = None
        self.channel_ok = True
        self._done = threading.Event()
        #: Set by whoever reads the driver's frames (elastic tasks); None: this supervisor reads them.
        self._aborted = aborted

    def send(self, kind: Kind, body: bytes) -> None:
        """Send a frame; after the driver went away, keep going silently (the pipes must be drained)."""
        if not self.channel_ok:
            return
        try:
            self.channel.send(kind, body)
        except ChannelError:
            self.channel_ok = False

    def emit(self, line: LogLine) -> None:
        """Forward one output line of the worker."""
        self.send(Kind.LOG, line.encode())

    def _spawn(self, env: dict[str, str]) -> RankProcess:
        # Spark reuses its python workers between tasks, so a template started after an earlier job
        # of this driver is still here: fork the rank from it (imports already paid).
        template = warm.ready_template() if self.spec.warm() else None
        if template is not None:
            try:
                return template.spawn(env, os.getcwd())
            except OSError:
                pass
        # Started from the task's main thread: the worker's PR_SET_PDEATHSIG follows this thread.
        return subprocess.Popen(
            _argv(self.spec), env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, start_new_session=True, close_fds=True,
        )

    def run(self, env: dict[str, str]) -> int:
        """Start the worker, forward its output, stop it on abort; return its exit code."""
        self.proc = self._spawn(env)
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
        finally:
            self._done.set()
            terminate_tree([self.proc.pid], 0.5)
        for t in pumps:
            t.join(DRAIN_WAIT_S)
        return returncode

    def _abort_watch(self) -> None:
        if self._aborted is not None:
            self._aborted.wait()
        else:
            self.channel.wait_for_abort()
        if not self._done.is_set() and self.proc is not None:
            terminate_tree([self.proc.pid], self.spec.teardown_grace_s)


def _status(rank: int, returncode: int, reported: bool, error: str = "") -> str:
    return json.dumps({"rank": rank, "exit": returncode, "reported": reported, "error": error})


def supervise(spec: TaskSpec, rank: int, hosts: list[str], gpus: list[list[str]]) -> str:
    """Run one rank to its end; return a JSON status (rank, exit code, whether the driver heard it).

    Args:
        spec: the job's task spec.
        rank: this task's barrier partition id.
        hosts: every task's executor host, in partition order.
        gpus: every task's GPU addresses, in partition order.
    """
    try:
        channel = WorkerChannel.connect(spec.job.channel, spec.job.secret, rank, Role.SUPERVISOR,
                                        spec.job.start_timeout_s)
    except ChannelError as e:
        return _status(rank, EXIT_NOT_STARTED, False, str(e))
    supervisor = _Supervisor(spec, channel, rank)
    try:
        env = _rank_env(spec, assign_ranks(hosts)[rank], _gpu_env(spec, hosts, gpus, rank))
        returncode = supervisor.run(env)
    except (PhalanxError, OSError) as e:
        supervisor.send(Kind.ERROR, ErrorRecord.from_exception(rank, e).encode())
        returncode = EXIT_NOT_STARTED
    supervisor.send(Kind.EVENT, exit_event(returncode))
    channel.close()
    if spec.warm() and spec.warm_preload is not None:
        warm.prepare(spec.warm_preload)  # in the background, for this driver's next job
    return _status(rank, returncode, supervisor.channel_ok)


class _Commands:
    """Reads an elastic task's control connection: the driver's ``{"spawn": worker_id}`` commands, or its end.

    ``aborted`` is set when the driver sends ABORT or goes away (the job is over, or failed).
    """

    def __init__(self, control: WorkerChannel) -> None:
        self.aborted = threading.Event()
        self._control = control
        self._spawns: queue.Queue[int | None] = queue.Queue()
        threading.Thread(target=self._read, name="phalanx-commands", daemon=True).start()

    def _read(self) -> None:
        while True:
            body = self._control.next_command()
            if body is None:
                break
            try:
                self._spawns.put(int(json.loads(body)["spawn"]))
            except (ValueError, KeyError, TypeError):
                continue  # not a command this task knows
        self.aborted.set()
        self._spawns.put(None)

    def next_spawn(self) -> int | None:
        """Block until the driver asks for a replacement worker (its id), or ends the job (None)."""
        return self._spawns.get()


def _elastic_env(spec: TaskSpec, hosts: list[str], gpus: list[list[str]], slot: int, worker: int) -> dict[str, str]:
    # The channel rank is the worker id; the torch rank comes from the driver's round (phalanx.env.elastic).
    who = replace(assign_ranks(hosts)[slot], rank=worker, size=spec.worker_ids)
    own = {N.PHALANX_ELASTIC_WORKER_ID: str(worker), N.PHALANX_ELASTIC_TIMEOUT_S: f"{spec.elastic_timeout_s:g}"}
    return _rank_env(spec, who, _gpu_env(spec, hosts, gpus, slot), own)


def _run_worker(spec: TaskSpec, channel: WorkerChannel, worker: int, env_for: Callable[[int], dict[str, str]],
                aborted: threading.Event) -> int:
    supervisor = _Supervisor(spec, channel, worker, aborted)
    try:
        returncode = supervisor.run(env_for(worker))
    except (PhalanxError, OSError) as e:
        supervisor.send(Kind.ERROR, ErrorRecord.from_exception(worker, e).encode())
        returncode = EXIT_NOT_STARTED
    supervisor.send(Kind.EVENT, exit_event(returncode))
    return returncode


def _connect(spec: TaskSpec, worker: int) -> WorkerChannel:
    return WorkerChannel.connect(spec.job.channel, spec.job.secret, worker, Role.SUPERVISOR, spec.job.start_timeout_s)


def _slot_loop(spec: TaskSpec, control: WorkerChannel, commands: _Commands,
               env_for: Callable[[int], dict[str, str]], slot: int) -> str:
    """Run the slot's workers one after the other; return the last one's status."""
    worker, channel = slot, control
    while True:
        returncode = _run_worker(spec, channel, worker, env_for, commands.aborted)
        if channel is not control:
            channel.close()
        nxt = None if returncode == 0 or commands.aborted.is_set() else commands.next_spawn()
        if nxt is None:
            return _status(worker, returncode, True)
        worker = nxt
        try:
            channel = _connect(spec, worker)
        except ChannelError as e:
            return _status(worker, EXIT_NOT_STARTED, False, str(e))


def supervise_slot(spec: TaskSpec, slot: int, hosts: list[str], gpus: list[list[str]]) -> str:
    """An elastic job's task: run this slot's worker; when it dies (the executor lives), wait for the
    driver's decision and start the replacement worker it names in this slot, until the job ends.

    The control connection (channel rank = slot, the slot's first worker id) carries the driver's
    commands; each replacement's output and exit travel on a connection of its own worker id.
    """
    try:
        control = _connect(spec, slot)
    except ChannelError as e:
        return _status(slot, EXIT_NOT_STARTED, False, str(e))
    commands = _Commands(control)
    try:
        status = _slot_loop(spec, control, commands, lambda w: _elastic_env(spec, hosts, gpus, slot, w), slot)
    finally:
        control.close()
        commands.aborted.set()  # releases the abort watchers of this task's workers
    if spec.warm() and spec.warm_preload is not None:
        warm.prepare(spec.warm_preload)
    return status


def barrier_task(spec: TaskSpec) -> Any:
    """The function to pass to ``rdd.barrier().mapPartitions``: it supervises this task's rank."""

    def task(_: Iterator[Any]) -> Iterator[str]:
        from pyspark import BarrierTaskContext

        ctx = BarrierTaskContext.get()
        # Every task learns every task's host and GPUs (in partition order) in one barrier round.
        mine = {"host": task_host(), "gpus": task_gpus(dict(ctx.resources()))}
        gathered = [json.loads(m) for m in ctx.allGather(json.dumps(mine))]
        hosts, gpus = [g["host"] for g in gathered], [g["gpus"] for g in gathered]
        run_task = supervise_slot if spec.elastic_timeout_s is not None else supervise
        yield run_task(spec, ctx.partitionId(), hosts, gpus)

    return task
