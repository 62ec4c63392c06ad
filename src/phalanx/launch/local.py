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
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from phalanx.env import JobContract, assign_ranks, compose_env, worker_env
from phalanx.env import names as env_names
from phalanx.env.contract import teardown_grace_s
from phalanx.errors import PhalanxError
from phalanx.job.channel import DriverChannel, Role
from phalanx.job.logs import ConsoleSink, FileSink, LogSink, pump_lines
from phalanx.job.monitor import JobMonitor, MonitorConfig, RankExit
from phalanx.job.progress import Progress
from phalanx.job.records import LogLine, Stream
from phalanx.launch import warm
from phalanx.launch.core import DRAIN_WAIT_S, monitor_config, new_run_id, python_command, spawn_rank, worker_argv
from phalanx.launch.fr_dump import DumpDir
from phalanx.launch.proctree import terminate_tree
from phalanx.launch.rendezvous import RendezvousStore
from phalanx.launch.warm import RankProcess
from phalanx.observe import ObserveOptions, open_watch
from phalanx.observe import resolve as resolve_observe

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LocalJobSpec:
    """Everything a local job needs; validated by the public entry points before construction.

    Attributes:
        np: number of ranks.
        payload: serialized call for a function job; empty for a command job.
        command: the command each rank runs; None for a function job.
        env: extra variables for every rank (the contract wins on conflicts).
        start_timeout_s: seconds every rank has to reach the channel (function jobs).
        start_timeout_hint: the knob to name in a start-timeout error.
        prefix: prefix each output line with ``[rank]<stream>:``.
        prefix_timestamp: start each output line with the local time (horovodrun's
            ``--prefix-output-with-timestamp``).
        output_dir: also keep each rank's output under this directory.
        teardown_grace_s: seconds between SIGTERM and SIGKILL on teardown.
        warm_preload: for function jobs, the modules a warm-start template should import; None turns
            warm starts off for this job.
        observe: the job's live page and MLflow logging (docs/observe.md); None: neither (default:
            ``PHALANX_DASHBOARD`` / ``PHALANX_MLFLOW``).
        progress: say on stderr what the start waits for (the warm-start template, the ranks started);
            False: ``phalanxrun -q``, ``phalanx.run(quiet=True)``.
    """

    np: int
    payload: bytes = b""
    command: tuple[str, ...] | None = None
    env: dict[str, str] = field(default_factory=dict)
    start_timeout_s: float = 30.0
    start_timeout_hint: str = "start_timeout"
    prefix: bool = True
    prefix_timestamp: bool = False
    output_dir: str | None = None
    teardown_grace_s: float = field(default_factory=teardown_grace_s)
    warm_preload: tuple[str, ...] | None = None
    observe: ObserveOptions | None = field(default_factory=resolve_observe)
    progress: bool = True


class LocalLauncher:
    """Starts, watches and tears down one local job. Use :meth:`run` once."""

    def __init__(self, spec: LocalJobSpec) -> None:
        # An observed job's ranks send stats records (every launcher built on this one lays spec.env over theirs).
        self.spec = replace(spec, env={**spec.observe.rank_env(), **spec.env}) if spec.observe else spec
        self._procs: list[RankProcess] = []
        self._threads: list[threading.Thread] = []
        self._stop_lock = threading.Lock()
        self._run_id = new_run_id()
        self.progress = Progress(enabled=spec.progress)

    def run(self) -> list[Any]:
        """Run the job to its end; return each rank's value (None for commands) in rank order."""
        watch = open_watch(self.spec.observe, self._run_id, self.spec.np)
        address = self._address()
        files = FileSink(self.spec.output_dir) if self.spec.output_dir else None  # refused before anything starts
        channel = DriverChannel(self._channel_size(), self.spec.payload, bind_host=address)
        store = RendezvousStore(self._channel_size(), channel.secret, bind_host=address)
        sinks: list[LogSink] = [ConsoleSink(self.spec.prefix, self.spec.prefix_timestamp)] + ([files] if files else [])
        monitor = self._monitor(channel, sinks)
        monitor.observer = watch.observe if watch is not None else None
        monitor.progress = self.progress
        try:
            self._start(channel, store)
            return monitor.run()
        except BaseException:
            self.progress.finish()  # Ctrl-C during the start: its one line goes on a line of its own
            self._stop_all()
            raise
        finally:
            self._stop_all(grace_s=0.5)
            channel.events.close()  # the job is judged: readers of the ranks' pipes must not block any more
            self._join_threads()
            channel.close()
            self._remove_leftovers(store)
            store.close()
            if files:
                files.close()
            if watch is not None:
                watch.close()
            if self.spec.command is None and self.spec.warm_preload is not None:
                warm.prepare(self.spec.warm_preload)

    def _address(self) -> str:
        """The address the channel and the store listen on and the ranks connect to: loopback here."""
        return "127.0.0.1"

    @staticmethod
    def _remove_leftovers(store: RendezvousStore) -> None:
        """The ranks are gone: shared-memory files a rank killed during its transport's set-up left on this
        host are removed now (their names are in the store), not by some later job's sweep."""
        removed = store.remove_shm_leftovers()
        if removed:
            log.debug("removed shared-memory files left by killed ranks: %s", removed)

    def _channel_size(self) -> int:
        """How many worker ids the channel accepts (subclasses that replace workers need more)."""
        return self.spec.np

    def _monitor(self, channel: DriverChannel, sinks: list[LogSink]) -> JobMonitor:
        return JobMonitor(self._monitor_config(), channel.events, sinks, stop_all=self._stop_all)

    def _monitor_config(self) -> MonitorConfig:
        return monitor_config(self.spec.np, self.spec.command is None, self.spec.start_timeout_s,
                              self.spec.start_timeout_hint, self.spec.teardown_grace_s)

    def _contract(self, channel: DriverChannel, store: RendezvousStore) -> JobContract:
        return JobContract(
            run_id=self._run_id,
            master_addr=self._address(),
            master_port=store.port,
            channel=channel.address,
            secret=channel.secret,
            start_timeout_s=self.spec.start_timeout_s,
        )

    def _argv(self) -> list[str]:
        return worker_argv(self.spec.command)

    def _template(self) -> warm.Template | None:
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

    def _python_run(self) -> dict[str, Any] | None:
        if self.spec.command is None:
            return None
        return python_command(self.spec.command, os.environ.get("PATH"))

    def _spawn(self, env: dict[str, str], template: warm.Template | None) -> RankProcess:
        return spawn_rank(self._argv(), env, template, python=self._python_run())

    def _start(self, channel: DriverChannel, store: RendezvousStore) -> None:
        job = self._contract(channel, store)
        host = socket.gethostname()
        own = {env_names.PHALANX_PARENT_PID: str(os.getpid())}
        template = self._template()
        for who in assign_ranks([host] * self.spec.np):
            env = compose_env(os.environ, self.spec.env, {**worker_env(job, who), **own}, os.cpu_count())
            dumps = DumpDir.create(env)
            proc = self._spawn({**env, **dumps.env()}, template)
            self._procs.append(proc)
            self._watch(who.rank, proc, channel, dumps)
        if self.spec.command is not None:  # a command says no hello: its process started is all there is to say
            self.progress.count("ranks started", self.spec.np, self.spec.np)
        log.debug("started %d ranks (%s): pids %s", self.spec.np, "warm" if template else "cold",
                  [p.pid for p in self._procs])

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

    def _stop_all(self, grace_s: float | None = None) -> None:
        with self._stop_lock:
            live = [p.pid for p in self._procs if p.poll() is None]
            if live:
                log.debug("stopping ranks with pids %s", live)
            # Descendants of exited ranks (daemons that kept the pipes) are swept too.
            grace = self.spec.teardown_grace_s if grace_s is None else grace_s
            terminate_tree([p.pid for p in self._procs], grace, marker=(env_names.PHALANX_RUN_ID, self._run_id))
            for p in self._procs:
                try:
                    p.wait(timeout=5.0)
                except subprocess.TimeoutExpired as e:
                    raise PhalanxError(f"rank process {p.pid} survived SIGKILL") from e

    def _join_threads(self) -> None:
        for t in self._threads:
            t.join(DRAIN_WAIT_S)
