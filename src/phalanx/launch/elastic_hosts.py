"""Elastic jobs across hosts: the elastic driver of :mod:`phalanx.launch.elasticity`, its workers started by host
agents (:mod:`phalanx.launch.agent_driver`) as a hosts job starts its ranks.

Each worker has an agent of its own (over ssh, or a child on this machine), so one worker can be added or
retired without touching the others. Workers are placed as horovodrun places ranks (each host's slots in
turn); a replacement goes to the first usable host with a free slot. A host leaves the job when host
discovery no longer lists it (or lists fewer slots than it runs: its excess workers are retired) and when
an agent's ssh connection to it fails or drops (the host is taken as dead, as Horovod blacklists a failed
host). Its workers are retired: they count as lost at once, the world re-forms on the other hosts without
waiting for their ends, and their agents stop them. A host that discovery adds (or lists again) gets the
start-up check first (ssh, the interpreter, an importable phalanx; within the start timeout); one that fails
is left out for the rest of the job, with one warning naming it and the cause.
"""

from __future__ import annotations

import logging
import subprocess
import threading

from phalanx.env import JobContract
from phalanx.errors import InvalidArgumentError, PhalanxError
from phalanx.job.channel import Custom, DriverChannel
from phalanx.job.elastic_policy import HostsUpdated
from phalanx.job.progress import Progress
from phalanx.launch.core import JobSpec, new_run_id
from phalanx.launch.discovery import HostDiscovery
from phalanx.launch.driver import DriverAddress
from phalanx.launch.elasticity import Elasticity, ElasticSpec, elastic_env, poll_discovery, worker_id_budget
from phalanx.launch.hosts import check_host_name, is_local, place
from phalanx.launch.local import observed, run_on_driver
from phalanx.launch.remote import AgentHosts, HostsSpec
from phalanx.launch.ssh import host_problems

log = logging.getLogger(__name__)


class ElasticHostAgents:
    """The workers of an elastic job across ``hosts``, one host agent per worker (a rank starter and a
    :class:`~phalanx.launch.elasticity.Replacer`; see the module docstring).

    Args:
        spec: the job.
        elastic: the policy and the discovery script.
        hosts: the hosts of ``-H`` and how to reach them.
        run_id: the job's id.
    """

    def __init__(self, spec: JobSpec, elastic: ElasticSpec, hosts: HostsSpec, run_id: str) -> None:
        self.spec = spec
        self.elastic = elastic
        self.hosts = hosts
        self.target = min(spec.np, elastic.policy.max_np)
        #: The most workers at once: the policy's, when discovery may grow the world, else the first world's.
        self.most = elastic.policy.max_np if elastic.discovery_script else self.target
        self.channel_size = worker_id_budget(self.most, elastic.policy.reset_limit)
        self._slots = {h.host: h.slots for h in hosts.hosts}
        self._down: set[str] = set()
        self._initial = place(hosts.hosts, self.target)
        self.reach = AgentHosts(spec, hosts, list(self._slots), run_id, on_lost=self._host_lost)
        self.agents = self.reach.agents
        self.address = self.reach.address
        #: Worker id -> host (the monitor names hosts from it).
        self.host_of: list[str] = []
        self._agent_of: dict[int, subprocess.Popen[bytes]] = {}
        self._leaving: set[int] = set()
        self._lock = threading.RLock()
        self._job: JobContract | None = None
        self._channel: DriverChannel | None = None
        self._discovery: HostDiscovery | None = None

    def on_custom(self, event: Custom) -> None:
        """An agent's supervisor's EVENT frame (heartbeat, exit report)."""
        self.agents.on_custom(event, self.channel_size)

    def start(self, job: JobContract, channel: DriverChannel) -> None:
        """Start the first world's workers, each by its own agent; then poll the discovery script if any."""
        self._job, self._channel = job, channel
        self.agents.attach(channel)
        for _ in range(self.target):
            self._spawn()
        log.debug("started elastic job: %d workers", self.target)
        self._discovery = poll_discovery(self.elastic, self._on_hosts)

    def add(self, kept: list[int], count: int) -> list[int]:
        """Start up to ``count`` replacements on the first usable hosts with a free slot."""
        with self._lock:
            extra = min(count, self.free_slots(kept))
            return [self._spawn() for _ in range(extra)]

    def give_up(self) -> str:
        """Never: the policy judges the free slots."""
        return ""

    def leaving(self) -> set[int]:
        """The workers being stopped because their host left the job."""
        return set(self._leaving)

    def stop(self, grace_s: float) -> None:
        """See :meth:`~phalanx.launch.remote.AgentHosts.stop`."""
        self.reach.stop(grace_s)

    def unfinished(self) -> list[int]:
        """The workers whose end no agent reported."""
        return [w for w in range(len(self.host_of)) if not self.agents.exits.reported([w])]

    def close(self) -> None:
        """Stop polling the discovery script; join the agents' readers and waiters."""
        if self._discovery is not None:
            self._discovery.stop()
        self.reach.close()

    def _spawn(self) -> int:
        assert self._job is not None
        wid = len(self.host_of)
        own = elastic_env(wid, self.elastic, self.target, self.channel_size)
        with self._lock:
            host = self._initial[wid] if wid < len(self._initial) else self._free_host()
            self.host_of.append(host)
        if is_local(host):
            self.agents.local.add(host)
        plan = self.reach.plan(self._job, (host,) * self.channel_size, (wid,), host, over=own)
        self._agent_of[wid] = self.agents.start(host, plan)
        log.debug("elastic worker %d on host %s", wid, host)
        return wid

    def _running(self, alive: list[int]) -> dict[str, int]:
        counts = dict.fromkeys(self._usable(), 0)
        for wid in alive:
            if self.host_of[wid] in counts:
                counts[self.host_of[wid]] += 1
        return counts

    def _usable(self) -> dict[str, int]:
        return {h: n for h, n in self._slots.items() if h not in self._down}

    def _free_host(self) -> str:
        alive = [w for w in range(len(self.host_of)) if w not in self._leaving and not self._ended(w)]
        running = self._running(alive)
        free = [h for h, n in self._usable().items() if running[h] < n]
        if not free:
            raise PhalanxError(f"elastic job: no host has a free slot for a replacement (slots {self._usable()}, "
                               f"running {running})")
        return free[0]

    def _ended(self, wid: int) -> bool:
        return self.agents.exits.reported([wid])

    def free_slots(self, alive: list[int]) -> int:
        """Free slots on the usable hosts, up to the target size."""
        with self._lock:
            running = self._running(alive)
            capacity = sum(max(0, n - running[h]) for h, n in self._usable().items())
            return max(0, min(self.target - len(alive), capacity))

    def _on_hosts(self, hosts: dict[str, int]) -> None:
        # In the discovery thread: the discovered hosts replace the known ones (a host that failed its check or
        # its ssh stays out); workers beyond a host's new slots are retired, and the monitor may grow the world.
        valid = {}
        for host, slots in hosts.items():
            try:
                valid[check_host_name(host, "host discovery")] = slots
            except InvalidArgumentError as e:
                log.warning("%s; line ignored", e)
        self._check_joined(valid)
        with self._lock:
            self._slots = valid
            self._retire_excess()
            usable = sum(self._usable().values())
            self.target = max(1, min(usable, self.elastic.policy.max_np))
        assert self._channel is not None
        self._channel.events.put(HostsUpdated(usable))

    def _check_joined(self, hosts: dict[str, int]) -> None:
        # A host that joins (or comes back) gets the start-up check before any worker goes there, within the
        # start timeout; one that fails stays out of the job, as Horovod blacklists a host whose workers fail.
        with self._lock:
            known = set(self._slots) | self._down
        joined = [h for h in hosts if h not in known and not is_local(h)]
        problems = host_problems(joined, self.hosts.ssh, self.reach.python, self.spec.start_timeout_s)
        for problem in problems.values():
            log.warning("elastic job: left out a host that host discovery added: %s",
                        " ".join(line.strip() for line in problem.splitlines()))
        with self._lock:
            self._down.update(problems)

    def _host_lost(self, host: str) -> None:
        # In an agent's watcher thread, before that worker's end is posted: no replacement goes there.
        log.warning("elastic job: ssh to host %s failed or dropped; the host leaves the job", host)
        with self._lock:
            self._down.add(host)
            self._retire_excess()
            usable = sum(self._usable().values())
            self.target = max(1, min(self.target, usable))
        assert self._channel is not None
        self._channel.events.put(HostsUpdated(usable))  # the monitor re-forms without the host's workers now

    def _retire_excess(self) -> None:
        alive = [w for w in range(len(self.host_of)) if w not in self._leaving and not self._ended(w)]
        usable = self._usable()
        kept: dict[str, int] = {}
        for wid in alive:
            host = self.host_of[wid]
            kept[host] = kept.get(host, 0) + 1
            if kept[host] > usable.get(host, 0):
                log.warning("elastic job: stopping worker %d on host %s (the host left the job or has fewer slots)",
                            wid, host)
                self._leaving.add(wid)
                self.agents.retire(self._agent_of[wid])


class ElasticHostsLauncher:
    """An elastic job whose workers run on ``hosts`` (see the module docstring); use :meth:`run` once."""

    def __init__(self, spec: JobSpec, elastic: ElasticSpec, hosts: HostsSpec) -> None:
        self.spec = observed(spec)
        self.run_id = new_run_id()
        self.starter = ElasticHostAgents(self.spec, elastic, hosts, self.run_id)
        self.elasticity = Elasticity(elastic, self.starter, self.starter.target, self.starter.most)

    def run(self) -> list[object]:
        """Check the hosts of ``-H``, then run the job (see :meth:`~phalanx.launch.local.LocalLauncher.run`)."""
        starter = self.starter
        starter.reach.check()
        return run_on_driver(self.spec, starter, DriverAddress(starter.address, starter.address), self.run_id,
                             Progress(enabled=self.spec.progress), elasticity=self.elasticity,
                             on_custom=starter.on_custom, rank_hosts=starter.host_of)
