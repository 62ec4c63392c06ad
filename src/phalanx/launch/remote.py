"""Run a job across machines: one host agent per host, started over ssh (or as a child on this machine).

The third user of the launcher core: :class:`HostsLauncher` is the local launcher's driver with another
starter, :class:`HostAgents` — the channel and the store listen on an address the hosts reach, and each
host's ranks are started and supervised by that host's agent (:mod:`phalanx.launch.host_agent`), which
forwards their output and exits on the channel as Spark's barrier tasks do. The monitor, the root-cause
report and the teardown are the driver's (:mod:`phalanx.launch.driver`).
"""

from __future__ import annotations

import logging
import os
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from phalanx.env import JobContract
from phalanx.job.channel import Custom, DriverChannel
from phalanx.job.progress import Progress
from phalanx.launch.agent_driver import AgentGroup, driver_address, plan_env, script_modules, silence_limit
from phalanx.launch.core import DRAIN_WAIT_S, JobSpec, new_run_id
from phalanx.launch.driver import DriverAddress
from phalanx.launch.host_agent import AgentPlan
from phalanx.launch.hosts import HostSlots, is_local, place
from phalanx.launch.local import observed, reap, run_on_driver
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


class AgentHosts:
    """What every starter of host agents has: the hosts' agents, the driver's address they reach, the script's
    modules for the other hosts, the pre-flight check and the teardown.

    Args:
        spec: the job.
        hosts: the hosts and how to reach them.
        names: the job's host names (this machine's among them need no ssh).
        run_id: the job's id (marks its processes for the teardown's sweep).
        on_lost: called with a host whose agent's ssh failed or dropped (see
            :class:`~phalanx.launch.agent_driver.AgentGroup`).
    """

    def __init__(self, spec: JobSpec, hosts: HostsSpec, names: list[str], run_id: str,
                 on_lost: Callable[[str], None] | None = None) -> None:
        self.spec = spec
        self.hosts = hosts
        self.run_id = run_id
        local = {h for h in names if is_local(h)}
        self.remote = [h for h in names if h not in local]
        self.python = hosts.python or sys.executable
        self.address = driver_address(hosts.interfaces, self.remote)
        self.agents = AgentGroup(self.python, hosts.ssh, local, ExitReports(spec.command is None), on_lost=on_lost,
                                 silence_s=silence_limit({**os.environ, **hosts.forward_env, **spec.env}))
        #: A script job's modules for the agents of other hosts.
        self.modules = script_modules(spec.command) if self.remote else {}
        self._stop_lock = threading.Lock()

    def check(self) -> None:
        """The pre-flight check: every remote host answers over ssh and imports phalanx.

        Raises:
            PhalanxError: naming each host that failed and why.
        """
        check_hosts(self.remote, self.hosts.ssh, self.python, self.spec.start_timeout_s)

    def plan(self, job: JobContract, hosts: tuple[str, ...], ranks: tuple[int, ...], host: str,
             over: dict[str, str] | None = None) -> AgentPlan:
        """The plan of the agent on ``host`` for its ``ranks`` (``over``: variables over their contracts)."""
        env = plan_env(os.environ, self.hosts.forward_env, self.hosts.interfaces, self.spec.env)
        return AgentPlan(job=job, hosts=hosts, ranks=ranks, command=self.spec.command, env=env, cwd=os.getcwd(),
                         python=self.python, teardown_grace_s=self.spec.teardown_grace_s, over=over or {},
                         modules={} if host in self.agents.local else self.modules)

    def stop(self, grace_s: float) -> None:
        """Each agent stops its ranks on ABORT (their supervisors) and on the end of its stdin; what is left of
        the agents is reaped."""
        with self._stop_lock:
            self.agents.stop(grace_s)
            reap(self.agents.procs, grace_s, self.run_id)

    def close(self) -> None:
        """Join the agents' readers and waiters."""
        for t in self.agents.threads:
            t.join(DRAIN_WAIT_S)


class HostAgents:
    """The ranks as children of one host agent per host (a :class:`~phalanx.launch.driver.RankStarter`).

    Args:
        spec: the job (the same description as a local job).
        hosts: where it runs.
        run_id: the job's id.
        progress: tells what the start waits for.
    """

    def __init__(self, spec: JobSpec, hosts: HostsSpec, run_id: str, progress: Progress | None = None) -> None:
        self.spec = spec
        self.progress = progress or Progress(enabled=False)
        self.placement = place(hosts.hosts, spec.np)
        self._order = list(dict.fromkeys(self.placement))
        self.reach = AgentHosts(spec, hosts, self._order, run_id)
        self.address = self.reach.address

    def on_custom(self, event: Custom) -> None:
        """An agent's supervisor's EVENT frame (heartbeat, exit report)."""
        self.reach.agents.on_custom(event, self.spec.np)

    def start(self, job: JobContract, channel: DriverChannel) -> None:
        """Start one agent per host, each with its ranks' plan."""
        agents = self.reach.agents
        agents.attach(channel)
        self.progress.step(f"starting the ranks' agents on {len(self._order)} host(s), {len(self.reach.remote)} "
                           "over ssh")
        for host in self._order:
            ranks = tuple(r for r, h in enumerate(self.placement) if h == host)
            agents.start(host, self.reach.plan(job, tuple(self.placement), ranks, host))
        log.debug("started agents on %s (driver address %s)", self._order, self.address)

    def stop(self, grace_s: float) -> None:
        """See :meth:`AgentHosts.stop`."""
        self.reach.stop(grace_s)

    def unfinished(self) -> list[int]:
        """The ranks whose end no agent reported."""
        return [r for r in range(self.spec.np) if not self.reach.agents.exits.reported([r])]

    def close(self) -> None:
        """See :meth:`AgentHosts.close`."""
        self.reach.close()


class HostsLauncher:
    """Runs one job across hosts; use :meth:`run` once.

    Args:
        spec: the job (the same description as a local job).
        hosts: where it runs.
    """

    def __init__(self, spec: JobSpec, hosts: HostsSpec) -> None:
        self.spec = observed(spec)
        self.run_id = new_run_id()
        self.progress = Progress(enabled=self.spec.progress)
        self.starter = HostAgents(self.spec, hosts, self.run_id, self.progress)

    def check(self) -> None:
        """See :meth:`AgentHosts.check`."""
        self.starter.reach.check()

    def run(self) -> list[object]:
        """Check the hosts, then run the job to its end (see :meth:`LocalLauncher.run`)."""
        remote = self.starter.reach.remote
        if remote:
            self.progress.step(f"checking {len(remote)} host(s) over ssh")
        try:
            self.check()
        except BaseException:
            self.progress.finish()  # the error is printed on a line of its own
            raise
        starter = self.starter
        return run_on_driver(self.spec, starter, DriverAddress(starter.address, starter.address), self.run_id,
                             self.progress, on_custom=starter.on_custom, rank_hosts=tuple(starter.placement))
