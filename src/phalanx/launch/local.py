"""Run N ranks as child processes of this host.

Each rank is a fresh interpreter (or the user's command) in its own session and process group, with
stdout/stderr on pipes read line by line. On the first failure, on a start timeout and on Ctrl-C every
rank's whole process tree is stopped (SIGTERM, grace, SIGKILL) before the error is raised.
"""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

from phalanx.env import JobContract, RankIdentity, assign_ranks, compose_env, worker_env
from phalanx.env import names as env_names
from phalanx.errors import PhalanxError
from phalanx.job.channel import Custom, DriverChannel, Role
from phalanx.job.logs import ConsoleSink, FileSink, LogSink, pump_lines
from phalanx.job.monitor import RankExit
from phalanx.job.progress import Progress
from phalanx.job.records import LogLine, Stream
from phalanx.launch import warm
from phalanx.launch.core import DRAIN_WAIT_S, JobSpec, new_run_id, python_command, spawn_rank, worker_argv
from phalanx.launch.driver import DriverAddress, ElasticPart, JobDriver, RankStarter
from phalanx.launch.fr_dump import DumpDir
from phalanx.launch.proctree import terminate_tree
from phalanx.launch.warm import RankProcess

log = logging.getLogger(__name__)

#: Seconds the ranks left after the verdict get between SIGTERM and SIGKILL (descendants that kept a pipe).
REAP_GRACE_S = 0.5


def observed(spec: JobSpec) -> JobSpec:
    """``spec`` whose ranks send stats records when the job is observed (the user's variables win)."""
    return replace(spec, env={**spec.observe.rank_env(), **spec.env}) if spec.observe else spec


def driver_sinks(spec: JobSpec) -> tuple[list[LogSink], FileSink | None]:
    """Where a driver-side job's output goes: the console, and ``output_dir`` (refused before anything
    starts when unsafe); return the sinks and the file sink to close."""
    files = FileSink(spec.output_dir) if spec.output_dir else None
    console: list[LogSink] = [ConsoleSink(spec.prefix, spec.prefix_timestamp)]
    return console + ([files] if files else []), files


def run_on_driver(spec: JobSpec, starter: RankStarter, address: DriverAddress, run_id: str, progress: Progress,
                  elasticity: ElasticPart | None = None, on_custom: Callable[[Custom], None] | None = None,
                  rank_hosts: Sequence[str] = ()) -> list[Any]:
    """Run a job whose ranks this process reaps (local forks, host agents); return the values (the other
    arguments: see :class:`~phalanx.launch.driver.JobDriver`)."""
    sinks, files = driver_sinks(spec)
    driver = JobDriver(spec, starter, address, sinks, run_id=run_id, elasticity=elasticity, on_custom=on_custom,
                       progress=progress, rank_hosts=rank_hosts, stop_reaps_s=REAP_GRACE_S, sweep_shm=True)
    try:
        return driver.run()
    finally:
        if files:
            files.close()


def reap(procs: Sequence[RankProcess | subprocess.Popen[bytes]], grace_s: float, run_id: str) -> None:
    """Stop the process trees of ``procs`` (children of this process), and the descendants of those that
    exited (daemons that kept the pipes) marked with the job's ``run_id``: SIGTERM, ``grace_s``, SIGKILL.

    Raises:
        PhalanxError: a process survived SIGKILL.
    """
    live = [p.pid for p in procs if p.poll() is None]
    if live:
        log.debug("stopping processes %s", live)
    terminate_tree([p.pid for p in procs], grace_s, marker=(env_names.PHALANX_RUN_ID, run_id))
    for p in procs:
        try:
            p.wait(timeout=5.0)
        except subprocess.TimeoutExpired as e:
            raise PhalanxError(f"rank process {p.pid} survived SIGKILL") from e


class LocalForks:
    """The ranks as children of this process (a :class:`~phalanx.launch.driver.RankStarter`): forked from a
    warm-start template when one fits, else fresh processes; their pipes are pumped into the channel's
    events and their ends reported there.

    Args:
        spec: the job.
        run_id: the job's id (marks its processes for the teardown's sweep).
        progress: tells what the start waits for (the warm-start template; a command job's ranks started).
    """

    def __init__(self, spec: JobSpec, run_id: str, progress: Progress | None = None) -> None:
        self.spec = spec
        self.run_id = run_id
        self.progress = progress or Progress(enabled=False)
        self.job: JobContract | None = None
        self._channel: DriverChannel | None = None
        self._procs: list[RankProcess] = []  # index: worker id
        self._threads: list[threading.Thread] = []
        self._stop_lock = threading.Lock()

    def start(self, job: JobContract, channel: DriverChannel) -> None:
        """Start ranks ``0..np-1`` here."""
        self.attach(job, channel)
        template = self.template()
        for who in assign_ranks([socket.gethostname()] * self.spec.np):
            self.spawn(who, {}, template)
        if self.spec.command is not None:  # a command says no hello: its process started is all there is to say
            self.progress.count("ranks started", self.spec.np, self.spec.np)
        log.debug("started %d ranks (%s): pids %s", self.spec.np, "warm" if template else "cold",
                  [p.pid for p in self._procs])

    def attach(self, job: JobContract, channel: DriverChannel) -> None:
        """The job's contract and channel, before any :meth:`spawn`."""
        self.job, self._channel = job, channel

    def template(self) -> warm.Template | None:
        """The warm-start template to fork ranks from: for function jobs, and for command jobs that run a
        script or module with this interpreter (:func:`~phalanx.launch.core.python_command`)."""
        if self.spec.command is None:
            preload = self.spec.warm_preload
        else:
            preload = () if self._python_run() is not None else None
        if preload is None:
            return None
        if warm.enabled() and warm.ready_template(0.0) is None:
            self.progress.step(f"waiting for the warm-start template to import torch (once, for all {self.spec.np} "
                               "ranks)")
        return warm.template_for_job(preload, warm.job_wait_s(self.spec.start_timeout_s))

    def spawn(self, who: RankIdentity, own: dict[str, str], template: warm.Template | None) -> None:
        """Start worker ``who.rank`` (the next worker id) with the variables ``own`` over its contract."""
        assert self.job is not None and self._channel is not None
        assert who.rank == len(self._procs), "workers start in the order of their ids"
        own = {env_names.PHALANX_PARENT_PID: str(os.getpid()), **own}
        env = compose_env(os.environ, self.spec.env, {**worker_env(self.job, who), **own}, os.cpu_count())
        dumps = DumpDir.create(env)
        argv = worker_argv(self.spec.command)
        proc = spawn_rank(argv, {**env, **dumps.env()}, template, python=self._python_run())
        self._procs.append(proc)
        self._watch(who.rank, proc, self._channel, dumps)

    def _python_run(self) -> dict[str, Any] | None:
        if self.spec.command is None:
            return None
        return python_command(self.spec.command, os.environ.get("PATH"))

    def _watch(self, rank: int, proc: RankProcess, channel: DriverChannel, dumps: DumpDir) -> None:
        assert proc.stdout is not None and proc.stderr is not None
        emit = channel.events.put
        pumps = [
            threading.Thread(target=pump_lines, args=(proc.stdout, rank, Stream.STDOUT, emit), daemon=True),
            threading.Thread(target=pump_lines, args=(proc.stderr, rank, Stream.STDERR, emit), daemon=True),
        ]
        waiter = threading.Thread(target=self._await_exit, args=(rank, proc, pumps, channel, dumps), daemon=True)
        for t in (*pumps, waiter):
            t.start()
        self._threads.extend((*pumps, waiter))

    def _await_exit(self, rank: int, proc: RankProcess, pumps: Sequence[threading.Thread],
                    channel: DriverChannel, dumps: DumpDir) -> None:
        returncode = proc.wait()
        ended_at = time.monotonic()
        for pump in pumps:
            pump.join(DRAIN_WAIT_S)
        for line in dumps.collect(failed=returncode != 0):
            channel.events.put(LogLine(rank, Stream.STDERR, line))
        if self.spec.command is None and channel.is_connected(rank):
            channel.worker_done(rank, DRAIN_WAIT_S)
        # The rank's connection may have been seen closed before this thread woke (a loaded driver): the
        # earlier time keeps a killed rank the root cause ahead of a peer's error about losing it.
        closed = channel.closed_at(rank, Role.WORKER)
        ended_at = min(ended_at, closed) if closed is not None else ended_at
        channel.events.put(RankExit(rank=rank, returncode=returncode, ended_at=ended_at))

    def stop(self, grace_s: float) -> None:
        """Stop every rank's process tree."""
        with self._stop_lock:
            reap(self._procs, grace_s, self.run_id)

    def unfinished(self) -> list[int]:
        """The workers whose process runs."""
        return [w for w, p in enumerate(self._procs) if p.poll() is None]

    def close(self) -> None:
        """Join the pumps and waiters; start the next job's warm-start template (function jobs)."""
        for t in self._threads:
            t.join(DRAIN_WAIT_S)
        if self.spec.command is None and self.spec.warm_preload is not None:
            warm.prepare(self.spec.warm_preload)


class LocalLauncher:
    """Starts, watches and tears down one local job. Use :meth:`run` once."""

    def __init__(self, spec: JobSpec) -> None:
        self.spec = observed(spec)
        self.run_id = new_run_id()
        self.progress = Progress(enabled=self.spec.progress)

    def run(self) -> list[Any]:
        """Run the job to its end; return each rank's value (None for commands) in rank order."""
        forks = LocalForks(self.spec, self.run_id, self.progress)
        return run_on_driver(self.spec, forks, DriverAddress.loopback(), self.run_id, self.progress)
