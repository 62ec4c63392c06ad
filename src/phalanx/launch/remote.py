"""Run a job across machines: one host agent per host, started over ssh (or as a child on this machine).

The third user of the launcher core: :class:`HostsLauncher` is a :class:`~phalanx.launch.local.LocalLauncher`
whose hooks differ only in *where* ranks start — the channel and the store listen on an address the
hosts reach, and each host's ranks are started and supervised by that host's agent
(:mod:`phalanx.launch.agent`), which forwards their output and exits on the channel as Spark's barrier
tasks do. The monitor, the root-cause report and the teardown are the core's.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass, field

from phalanx.env import JobContract
from phalanx.env import names as env_names
from phalanx.job.channel import Custom, DriverChannel
from phalanx.job.logs import LogSink
from phalanx.job.monitor import JobMonitor, MonitorConfig
from phalanx.job.records import ErrorRecord
from phalanx.launch.agent import AgentPlan
from phalanx.launch.core import DRAIN_WAIT_S
from phalanx.launch.hosts import HostSlots, is_local, place
from phalanx.launch.local import LocalJobSpec, LocalLauncher
from phalanx.launch.rendezvous import RendezvousStore
from phalanx.launch.ssh import SshOptions, agent_command, check_hosts, interface_address, route_address, ssh_argv
from phalanx.launch.supervisor import ExitReports

log = logging.getLogger(__name__)

#: Prefixes of the driver's variables every rank gets (horovodrun forwards these too).
FORWARDED_PREFIXES = ("HOROVOD_", "NCCL_", "PHALANX_")
#: Variables forwarded by name.
FORWARDED_NAMES = (env_names.PYTHONPATH,)
#: Seconds an agent that ended cleanly may take for its ranks' exit reports to be read.
REPORT_WAIT_S = 30.0
_AGENT_TAIL_LINES = 20


@dataclass(frozen=True)
class HostsSpec:
    """Where a multi-host job runs.

    Attributes:
        hosts: the hosts and their slots, in placement order.
        ssh: how to reach the hosts that are not this machine.
        interfaces: ``--network-interfaces``: the NIC whose address the channel and store listen on; empty:
            this machine's address on the route to the first remote host.
        python: the ranks' interpreter on every host (default: this driver's ``sys.executable``).
        forward_env: the user's variables for every rank (``-x``/``--env``, on top of the forwarded ones).
    """

    hosts: tuple[HostSlots, ...]
    ssh: SshOptions = field(default_factory=SshOptions)
    interfaces: tuple[str, ...] = ()
    python: str | None = None
    forward_env: dict[str, str] = field(default_factory=dict)


def forwarded_env(environ: dict[str, str] | os._Environ[str], extra: dict[str, str]) -> dict[str, str]:
    """The variables every rank gets from the driver: ``HOROVOD_*``, ``NCCL_*``, ``PHALANX_*``,
    ``PYTHONPATH``, then the user's ``extra`` (which wins)."""
    env = {k: v for k, v in environ.items() if k.startswith(FORWARDED_PREFIXES) or k in FORWARDED_NAMES}
    return {**env, **extra}


class HostsLauncher(LocalLauncher):
    """Runs one job across hosts; use :meth:`run` once.

    Args:
        spec: the job (the same description as a local job).
        hosts: where it runs.
    """

    def __init__(self, spec: LocalJobSpec, hosts: HostsSpec) -> None:
        super().__init__(spec)
        self.hosts = hosts
        self.placement = place(hosts.hosts, spec.np)
        self._order = list(dict.fromkeys(self.placement))
        self._local = {h for h in self._order if is_local(h)}
        self._remote = [h for h in self._order if h not in self._local]
        self._python = hosts.python or sys.executable
        self._addr = self._choose_address()
        self._agents: dict[str, subprocess.Popen[bytes]] = {}
        self._tails: dict[str, deque[str]] = {h: deque(maxlen=_AGENT_TAIL_LINES) for h in self._order}
        self._exits = ExitReports(spec.command is None)
        self._channel: DriverChannel | None = None
        self._stopping = threading.Event()

    def _choose_address(self) -> str:
        if self.hosts.interfaces:
            return interface_address(self.hosts.interfaces[0])
        if not self._remote:
            return "127.0.0.1"
        return route_address(self._remote[0])

    def check(self) -> None:
        """The pre-flight check: every remote host answers over ssh and imports phalanx.

        Raises:
            PhalanxError: naming each host that failed and why.
        """
        check_hosts(self._remote, self.hosts.ssh, self._python, self.spec.start_timeout_s)

    def run(self) -> list[object]:
        """Check the hosts, then run the job to its end (see :meth:`LocalLauncher.run`)."""
        self.check()
        return super().run()

    def _address(self) -> str:
        return self._addr

    def _monitor_config(self) -> MonitorConfig:
        base = super()._monitor_config()
        return MonitorConfig(**{**base.__dict__, "rank_hosts": tuple(self.placement)})

    def _monitor(self, channel: DriverChannel, sinks: list[LogSink]) -> JobMonitor:
        self._channel = channel
        self._exits.attach(channel)
        return JobMonitor(self._monitor_config(), channel.events, sinks,
                          stop_all=self._stop_all, on_custom=self._on_custom)

    def _plan(self, job: JobContract, host: str) -> AgentPlan:
        ranks = tuple(r for r, h in enumerate(self.placement) if h == host)
        env = {**forwarded_env(os.environ, self.hosts.forward_env), **self.spec.env}
        return AgentPlan(job=job, hosts=tuple(self.placement), ranks=ranks, command=self.spec.command, env=env,
                         cwd=os.getcwd(), python=self._python, teardown_grace_s=self.spec.teardown_grace_s)

    def _agent_argv(self, host: str) -> list[str]:
        if host in self._local:
            return [self._python, "-m", "phalanx.launch.agent"]
        return ssh_argv(host, self.hosts.ssh, agent_command(self._python, os.getcwd()))

    def _start(self, channel: DriverChannel, store: RendezvousStore) -> None:
        job = self._contract(channel, store)
        for host in self._order:
            proc = subprocess.Popen(self._agent_argv(host), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                    stderr=subprocess.STDOUT, start_new_session=True, close_fds=True)
            assert proc.stdin is not None
            self._agents[host] = proc
            self._procs.append(proc)
            try:
                proc.stdin.write(self._plan(job, host).encode())
                proc.stdin.flush()
            except OSError:
                pass  # the agent is gone already: its watcher reports why
            self._watch_agent(host, proc, channel)
        log.debug("started agents on %s (driver address %s)", self._order, self._addr)

    def _watch_agent(self, host: str, proc: subprocess.Popen[bytes], channel: DriverChannel) -> None:
        reader = threading.Thread(target=self._read_agent, args=(host, proc), daemon=True)
        waiter = threading.Thread(target=self._await_agent, args=(host, proc, reader, channel), daemon=True)
        reader.start()
        waiter.start()
        self._threads.extend((reader, waiter))

    def _read_agent(self, host: str, proc: subprocess.Popen[bytes]) -> None:
        assert proc.stdout is not None
        for raw in proc.stdout:
            line = raw.decode(errors="replace").rstrip("\n")
            self._tails[host].append(line)
            log.warning("host %s: %s", host, line)

    def _await_agent(self, host: str, proc: subprocess.Popen[bytes], reader: threading.Thread,
                     channel: DriverChannel) -> None:
        returncode = proc.wait()
        reader.join(DRAIN_WAIT_S)
        ranks = [r for r, h in enumerate(self.placement) if h == host]
        deadline = time.monotonic() + (REPORT_WAIT_S if returncode == 0 else DRAIN_WAIT_S)
        while time.monotonic() < deadline and not self._exits.reported(ranks) and not self._stopping.is_set():
            time.sleep(0.05)
        missing = [r for r in ranks if not self._exits.reported([r])]
        if not missing:
            return
        if not self._stopping.is_set():
            tail = "\n".join(self._tails[host]) or "(no output)"
            how = "ssh could not connect or lost the connection" if returncode == 255 else "it ended"
            channel.events.put(ErrorRecord(
                rank=missing[0], exc_type="phalanx.errors.PhalanxError",
                message=f"the agent on host {host} ended (exit code {returncode}; {how}) before rank(s) "
                        f"{missing} reported their end:\n{tail}", traceback=""))
        for rank in missing:
            self._exits.post(rank, returncode or 1)

    def _on_custom(self, event: Custom) -> None:
        if event.rank < self.spec.np:
            self._exits.on_event(event)

    def _stop_all(self, grace_s: float | None = None) -> None:
        # Each agent stops its ranks on ABORT (their supervisors) and on the end of its stdin.
        self._stopping.set()
        if self._channel is not None:
            self._channel.abort_all()
        for proc in self._agents.values():
            if proc.stdin is not None and not proc.stdin.closed:
                try:
                    proc.stdin.close()
                except OSError:
                    pass
        grace = self.spec.teardown_grace_s if grace_s is None else grace_s
        deadline = time.monotonic() + grace + DRAIN_WAIT_S
        for proc in self._agents.values():
            try:
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        super()._stop_all(grace_s)
