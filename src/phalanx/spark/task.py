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
import sys
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from phalanx.env import JobContract, RankIdentity, assign_ranks, compose_env, settings, worker_env
from phalanx.env import names as env_names
from phalanx.errors import ChannelError, PhalanxError
from phalanx.job.channel import Role, WorkerChannel
from phalanx.job.framing import Kind
from phalanx.job.records import ErrorRecord
from phalanx.launch import shared_template, warm
from phalanx.launch.core import worker_argv
from phalanx.launch.supervisor import EXIT_NOT_STARTED, RankSupervisor, exit_event
from phalanx.launch.warm import TemplateLink


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
        warm_wait_s: seconds a rank waits for a warm-start template still importing before it starts cold.
        ranks_per_task: ranks each barrier task runs (``spark.task.resource.gpu.amount`` when each task holds
            several GPUs, as pyspark's ``torchrun --nproc_per_node``): task ``t`` runs ranks ``t*k .. t*k+k-1``,
            rank ``t*k+j`` on the task's ``j``-th GPU.
        template: on the executor, this task's connection to its executor's shared template
            (:func:`warm_early`); never set on the driver, never pickled.
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
    warm_wait_s: float = warm.READY_WAIT_S
    ranks_per_task: int = 1
    template: TemplateLink | None = field(default=None, repr=False, compare=False)

    def warm(self) -> bool:
        """True when this job's ranks may be forked from a warm-start template."""
        off = not settings.WARM_START.get(self.env)
        return self.command is None and self.warm_preload is not None and not off and warm.enabled()


def task_host(environ: dict[str, str] | None = None) -> str:
    """The host this task runs on, as Spark names it: ``SPARK_LOCAL_HOSTNAME`` or ``SPARK_LOCAL_IP`` when
    the executor was given one (several workers on one machine), else the machine's hostname.

    Ranks are grouped into local ranks by this name: executors on one machine share its GPUs and NICs.
    """
    env = os.environ if environ is None else environ
    return env.get(env_names.SPARK_LOCAL_HOSTNAME) or env.get(env_names.SPARK_LOCAL_IP) or socket.gethostname()


def task_gpus(resources: Mapping[str, object], environ: dict[str, str] | None = None) -> list[str]:
    """The GPU addresses Spark gave this task (``TaskContext.resources()["gpu"]``), maybe none, as device ids
    of the machine.

    When the cluster manager restricted the executor with ``CUDA_VISIBLE_DEVICES`` (YARN, a container), Spark's
    addresses are indices into that list (pyspark's ``_get_gpus_owned`` reads them so): address ``i`` is the
    list's ``i``-th entry, so a rank's own ``CUDA_VISIBLE_DEVICES`` names the devices the executor was given.

    Raises:
        PhalanxError: an address is not an index into the executor's ``CUDA_VISIBLE_DEVICES``.
    """
    addresses = [str(a) for a in (getattr(resources.get("gpu"), "addresses", None) or [])]
    env = os.environ if environ is None else environ
    restricted = env.get(env_names.CUDA_VISIBLE_DEVICES)
    if restricted is None or not addresses:
        return addresses
    devices = [d.strip() for d in restricted.split(",") if d.strip()]
    bad = [a for a in addresses if not a.isdigit() or int(a) >= len(devices)]
    if bad:
        raise PhalanxError(
            f"Spark gave this task GPU address(es) {bad}, which are not indices into the executor's "
            f"CUDA_VISIBLE_DEVICES={restricted!r} (host {task_host(environ)}): make the GPU discovery script report "
            "indices into the devices the executor may use (0..n-1), or start the executor without "
            "CUDA_VISIBLE_DEVICES"
        )
    return [devices[int(a)] for a in addresses]


def task_resources(resources: Mapping[str, object]) -> dict[str, Any]:  # Any: a JSON message, extended by callers
    """What this task tells the others in the barrier round: its host, its GPUs, and why it has none when
    its addresses could not be read (``problem``)."""
    try:
        return {"host": task_host(), "gpus": task_gpus(resources)}
    except PhalanxError as e:
        return {"host": task_host(), "gpus": [], "problem": str(e)}


def rank_layout(hosts: list[str], gpus: list[list[str]], per_task: int) -> tuple[list[str], list[list[str]]]:
    """Every rank's host and GPUs, from every task's (in partition order) when each task runs ``per_task``
    ranks: rank ``t * per_task + j`` runs on task ``t``'s host with its ``j``-th GPU (none when the task has
    fewer GPUs than ranks: that rank's start then fails, naming it). With one rank per task, the rank keeps all
    of its task's GPUs."""
    if per_task == 1:
        return list(hosts), [list(g) for g in gpus]
    rank_hosts = [host for host in hosts for _ in range(per_task)]
    rank_gpus = [[task[j]] if j < len(task) else [] for task in gpus for j in range(per_task)]
    return rank_hosts, rank_gpus


def _gpu_env(spec: TaskSpec, hosts: list[str], gpus: list[list[str]], rank: int) -> dict[str, str]:
    """``CUDA_VISIBLE_DEVICES`` for a rank: the GPUs of every rank on its host, in local-rank order.

    So ``cuda:LOCAL_RANK`` (``torch.cuda.set_device(hvd.local_rank())``, DDP's ``device_ids=[local_rank]``)
    is this rank's own GPU when each rank has one (one GPU per task, or ``k`` ranks on a task of ``k`` GPUs),
    as under torchrun or horovodrun on a multi-GPU host.
    """
    if not spec.use_gpu:
        return {}
    if not gpus[rank]:
        if spec.ranks_per_task > 1:
            raise PhalanxError(
                f"the task of rank {rank} runs {spec.ranks_per_task} ranks (spark.task.resource.gpu.amount="
                f"{spec.ranks_per_task}) but Spark gave it fewer GPUs; check the executors' GPU discovery script "
                "and spark.executor.resource.gpu.amount"
            )
        raise PhalanxError(
            f"use_gpu=True but Spark gave the task of rank {rank} no GPU; set spark.executor.resource.gpu.amount "
            "and spark.task.resource.gpu.amount (with a GPU discovery script), or pass use_gpu=False"
        )
    same_host = [r for r, host in enumerate(hosts) if host == hosts[rank]]
    visible = dict.fromkeys(address for r in same_host for address in gpus[r])
    return {env_names.CUDA_VISIBLE_DEVICES: ",".join(visible)}


def _argv(spec: TaskSpec) -> list[str]:
    return worker_argv(None if spec.command is None else (sys.executable, *spec.command))


def _rank_env(spec: TaskSpec, who: RankIdentity, gpu_env: dict[str, str],
              extra: dict[str, str] | None = None) -> dict[str, str]:
    own = {env_names.PHALANX_PARENT_PID: str(os.getpid()), **gpu_env, **(extra or {})}
    if spec.log_to_driver:
        own[env_names.PHALANX_LOG_TO_DRIVER] = "1"
    return compose_env(os.environ, spec.env, {**worker_env(spec.job, who), **own}, os.cpu_count())


def _supervisor(spec: TaskSpec, channel: WorkerChannel, rank: int,
                aborted: threading.Event | None = None) -> RankSupervisor:
    return RankSupervisor(channel, rank, spec.teardown_grace_s, aborted)


def check_script(spec: TaskSpec) -> None:
    """A script job's script must exist on this executor: Spark ships no files, and Python's own "can't open
    file" would not say why.

    Raises:
        PhalanxError: the script is missing here (named, with the host and the fix).
    """
    if spec.command is not None and not os.path.isfile(spec.command[0]):
        raise PhalanxError(
            f"script {spec.command[0]!r} does not exist on executor host {task_host()}: a script runs from each "
            "executor's file system; put it at the same path on every executor (a shared file system), or pass "
            "the training function instead (its driver-local modules are shipped)"
        )


def _run_rank(spec: TaskSpec, supervisor: RankSupervisor, env: dict[str, str]) -> int:
    check_script(spec)
    # Started from the rank's supervising thread: a cold worker's PR_SET_PDEATHSIG follows this thread.
    return supervisor.run(_argv(spec), env, _template(spec))


def _template(spec: TaskSpec) -> TemplateLink | None:
    """The template this task's rank forks from: its executor's shared one (:func:`warm_early`; waited for up
    to ``warm_wait_s``: it imports what a cold rank would), else this python worker's own (one an earlier job
    left: Spark reuses its python workers, or one started now); None: the rank starts cold."""
    if not spec.warm():
        return None
    if spec.template is not None:
        return spec.template if spec.template.wait_ready(spec.warm_wait_s) else None
    return warm.template_for_job(spec.warm_preload or (), spec.warm_wait_s)


def warm_early(spec: TaskSpec) -> TaskSpec:
    """Connect this task to its executor's warm-start template when the job's ranks may fork from one, starting
    it if none runs: its imports (one for all of the executor's tasks and later jobs) then overlap the barrier
    round instead of following it. Where no shared template can be had, this python worker's own is started
    instead. Returns ``spec`` with the connection, and the ranks' wait for the template raised to half the start
    timeout (the rest is left for the ranks to connect); the caller closes the connection (:func:`done`)."""
    if not spec.warm():
        return spec
    link = shared_template.link(spec.warm_preload or ())
    if link is None:
        warm.prepare(spec.warm_preload or ())
    return replace(spec, warm_wait_s=max(spec.warm_wait_s, spec.job.start_timeout_s / 2), template=link)


def prestart(preload: tuple[str, ...]) -> None:
    """Start the executor's shared template (else this python worker's own) if none runs, without waiting."""
    if not warm.enabled():
        return
    link = shared_template.link(preload)
    if link is None:
        warm.prepare(preload)
    else:
        link.close()


def _after_job(spec: TaskSpec) -> None:
    """Start this python worker's own template in the background for the driver's next job, when the executor
    has no shared one."""
    if spec.warm() and spec.template is None and spec.warm_preload is not None:
        warm.prepare(spec.warm_preload)


def done(spec: TaskSpec) -> None:
    """The task ended: close its connection to the shared template (which kills a rank it still owned)."""
    if spec.template is not None:
        spec.template.close()


def _status(rank: int, returncode: int, reported: bool, error: str = "") -> str:
    return json.dumps({"rank": rank, "exit": returncode, "reported": reported, "error": error})


def supervise(spec: TaskSpec, rank: int, hosts: list[str], gpus: list[list[str]], problem: str = "") -> str:
    """Run one rank to its end; return a JSON status (rank, exit code, whether the driver heard it).

    Args:
        spec: the job's task spec.
        rank: the rank to run (one of this task's).
        hosts: every rank's executor host, in rank order (:func:`rank_layout`).
        gpus: every rank's GPU addresses, in rank order.
        problem: why this task cannot start its rank (found before the barrier round), or "".
    """
    try:
        channel = WorkerChannel.connect(spec.job.channel, spec.job.secret, rank, Role.SUPERVISOR,
                                        spec.job.start_timeout_s)
    except ChannelError as e:
        return _status(rank, EXIT_NOT_STARTED, False, str(e))
    supervisor = _supervisor(spec, channel, rank)
    try:
        if problem:
            raise PhalanxError(problem)
        env = _rank_env(spec, assign_ranks(hosts)[rank], _gpu_env(spec, hosts, gpus, rank))
        returncode = _run_rank(spec, supervisor, env)
    except (PhalanxError, OSError) as e:
        supervisor.send(Kind.ERROR, ErrorRecord.from_exception(rank, e).encode())
        returncode = EXIT_NOT_STARTED
    supervisor.send(Kind.EVENT, exit_event(returncode, supervisor.ended_at))
    channel.close()
    _after_job(spec)
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
    # The channel rank is the worker id; the torch rank comes from the driver's round (phalanx.env.rounds).
    who = replace(assign_ranks(hosts)[slot], rank=worker, size=spec.worker_ids)
    own = {env_names.PHALANX_ELASTIC_WORKER_ID: str(worker),
           env_names.PHALANX_ELASTIC_TIMEOUT_S: f"{spec.elastic_timeout_s:g}"}
    return _rank_env(spec, who, _gpu_env(spec, hosts, gpus, slot), own)


def _run_worker(spec: TaskSpec, channel: WorkerChannel, worker: int, env_for: Callable[[int], dict[str, str]],
                aborted: threading.Event) -> int:
    supervisor = _supervisor(spec, channel, worker, aborted)
    try:
        returncode = _run_rank(spec, supervisor, env_for(worker))
    except (PhalanxError, OSError) as e:
        supervisor.send(Kind.ERROR, ErrorRecord.from_exception(worker, e).encode())
        returncode = EXIT_NOT_STARTED
    supervisor.send(Kind.EVENT, exit_event(returncode, supervisor.ended_at))
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
    _after_job(spec)
    return status


def supervise_task(spec: TaskSpec, task: int, hosts: list[str], gpus: list[list[str]],
                   problem: str = "") -> list[str]:
    """Run this task's ranks (``spec.ranks_per_task`` of them) to their end; return their statuses.

    Each rank is supervised in a thread of its own that lives as long as the rank (its process's parent-death
    signal follows the thread that started it). A rank that fails is reported to the driver like any other,
    and the driver's abort then stops the task's other ranks.

    Args:
        spec: the job's task spec.
        task: this task's barrier partition id.
        hosts: every task's executor host, in partition order.
        gpus: every task's GPU addresses, in partition order.
        problem: why this task cannot give its ranks their GPUs (its GPU addresses could not be read); each
            of its ranks then fails with it.
    """
    rank_hosts, rank_gpus = rank_layout(hosts, gpus, spec.ranks_per_task)
    ranks = range(task * spec.ranks_per_task, (task + 1) * spec.ranks_per_task)

    def status(rank: int) -> str:
        if problem and spec.use_gpu:
            return supervise(spec, rank, rank_hosts, rank_gpus, problem)
        if spec.elastic_timeout_s is not None:
            return supervise_slot(spec, rank, rank_hosts, rank_gpus)
        return supervise(spec, rank, rank_hosts, rank_gpus)

    if len(ranks) == 1:
        return [status(ranks[0])]
    statuses: dict[int, str] = {}

    def one(rank: int) -> None:
        statuses[rank] = status(rank)

    threads = [threading.Thread(target=one, args=(r,), name=f"phalanx-rank-{r}") for r in ranks]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return [statuses.get(r) or _status(r, EXIT_NOT_STARTED, False, "its supervisor thread ended early")
            for r in ranks]


def barrier_task(spec: TaskSpec) -> Callable[[Iterable[object]], Iterator[str]]:
    """The function to pass to ``rdd.barrier().mapPartitions``: it supervises this task's ranks."""

    def task(_: Iterable[object]) -> Iterator[str]:
        from pyspark import BarrierTaskContext

        ctx = BarrierTaskContext.get()
        warmed = warm_early(spec)
        # Every task learns every task's host and GPUs (in partition order) in one barrier round.
        mine = task_resources(dict(ctx.resources()))
        gathered = [json.loads(m) for m in ctx.allGather(json.dumps(mine))]
        hosts, gpus = [g["host"] for g in gathered], [g["gpus"] for g in gathered]
        try:
            statuses = supervise_task(warmed, ctx.partitionId(), hosts, gpus, mine.get("problem", ""))
        finally:
            done(warmed)
        yield from statuses

    return task
