"""Run a job across machines: one host agent per host, started over ssh (or as a child on this machine).

The third user of the launcher core: :class:`HostsLauncher` is a :class:`~phalanx.launch.local.LocalLauncher`
whose hooks differ only in *where* ranks start — the channel and the store listen on an address the
hosts reach, and each host's ranks are started and supervised by that host's agent
(:mod:`phalanx.launch.host_agent`), which forwards their output and exits on the channel as Spark's barrier
tasks do. The monitor, the root-cause report and the teardown are the core's.
"""

from __future__ import annotations

import logging
import os
import sys
from dataclasses import dataclass, field

from phalanx.env import JobContract
from phalanx.job.channel import DriverChannel
from phalanx.job.logs import LogSink
from phalanx.job.monitor import JobMonitor, MonitorConfig
from phalanx.launch.agent_driver import AgentGroup, driver_address, plan_env, script_modules, silence_limit
from phalanx.launch.host_agent import AgentPlan
from phalanx.launch.hosts import HostSlots, is_local, place
from phalanx.launch.local import LocalJobSpec, LocalLauncher
from phalanx.launch.rendezvous import RendezvousStore
from phalanx.launch.ssh import SshOptions, check_hosts
from phalanx.launch.supervisor import ExitReports

log = logging.getLogger(__name__)


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
        local = {h for h in self._order if is_local(h)}
        self._remote = [h for h in self._order if h not in local]
        self._python = hosts.python or sys.executable
        self._addr = driver_address(hosts.interfaces, self._remote)
        self._agents = AgentGroup(self._python, hosts.ssh, local, ExitReports(spec.command is None),
                                  silence_s=silence_limit({**os.environ, **hosts.forward_env, **spec.env}))
        self._modules = script_modules(spec.command) if self._remote else {}

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
        self._agents.attach(channel)
        return JobMonitor(self._monitor_config(), channel.events, sinks, stop_all=self._stop_all,
                          on_custom=lambda event: self._agents.on_custom(event, self.spec.np))

    def _plan(self, job: JobContract, host: str) -> AgentPlan:
        ranks = tuple(r for r, h in enumerate(self.placement) if h == host)
        env = plan_env(os.environ, self.hosts.forward_env, self.hosts.interfaces, self.spec.env)
        return AgentPlan(job=job, hosts=tuple(self.placement), ranks=ranks, command=self.spec.command, env=env,
                         cwd=os.getcwd(), python=self._python, teardown_grace_s=self.spec.teardown_grace_s,
                         modules=self._modules if host in self._remote else {})

    def _start(self, channel: DriverChannel, store: RendezvousStore) -> None:
        job = self._contract(channel, store)
        self.progress.step(f"starting the ranks' agents on {len(self._order)} host(s), {len(self._remote)} over ssh")
        for host in self._order:
            self._procs.append(self._agents.start(host, self._plan(job, host)))
        self._threads.extend(self._agents.threads)
        log.debug("started agents on %s (driver address %s)", self._order, self._addr)

    def _stop_all(self, grace_s: float | None = None) -> None:
        # Each agent stops its ranks on ABORT (their supervisors) and on the end of its stdin.
        self._agents.stop(self.spec.teardown_grace_s if grace_s is None else grace_s)
        super()._stop_all(grace_s)
