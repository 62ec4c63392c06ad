"""Elastic jobs across hosts: the elastic driver of :mod:`phalanx.launch.elastic`, its workers started by host
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
import os
import subprocess
import sys
import threading

from phalanx.errors import InvalidArgumentError, PhalanxError
from phalanx.job.channel import DriverChannel
from phalanx.job.elastic import ElasticMonitor, HostsUpdated
from phalanx.job.logs import LogSink
from phalanx.job.monitor import JobMonitor, MonitorConfig
from phalanx.launch import warm
from phalanx.launch.agent_driver import AgentGroup, driver_address, plan_env, script_modules, silence_limit
from phalanx.launch.elastic import ElasticLocalLauncher, ElasticSpec
from phalanx.launch.host_agent import AgentPlan
from phalanx.launch.hosts import check_host_name, is_local, place
from phalanx.launch.local import LocalJobSpec
from phalanx.launch.remote import HostsSpec
from phalanx.launch.ssh import check_hosts, host_problems
from phalanx.launch.supervisor import ExitReports

log = logging.getLogger(__name__)


class ElasticHostsLauncher(ElasticLocalLauncher):
    """An elastic job whose workers run on ``hosts`` (see the module docstring); use :meth:`run` once."""

    def __init__(self, spec: LocalJobSpec, elastic: ElasticSpec, hosts: HostsSpec) -> None:
        super().__init__(spec, elastic)
        self.hosts = hosts
        self._slots = {h.host: h.slots for h in hosts.hosts}
        self._down: set[str] = set()
        self._initial = place(hosts.hosts, self._target)
        local = {h for h in self._slots if is_local(h)}
        self._remote = [h for h in self._slots if h not in local]
        self._python = hosts.python or sys.executable
        self._addr = driver_address(hosts.interfaces, self._remote)
        self._agents = AgentGroup(self._python, hosts.ssh, local, ExitReports(spec.command is None),
                                  on_lost=self._host_lost,
                                  silence_s=silence_limit({**os.environ, **hosts.forward_env, **spec.env}))
        self._host_of: list[str] = []  # worker id -> host (the monitor names hosts from it)
        self._agent_of: dict[int, subprocess.Popen[bytes]] = {}
        self._leaving: set[int] = set()
        self._lock = threading.RLock()
        self._modules = script_modules(spec.command) if self._remote else {}

    def run(self) -> list[object]:
        """Check the hosts of ``-H``, then run the job (see :meth:`ElasticLocalLauncher.run`)."""
        check_hosts(self._remote, self.hosts.ssh, self._python, self.spec.start_timeout_s)
        return super().run()

    def _address(self) -> str:
        return self._addr

    def _template(self) -> warm.Template | None:
        return None  # the workers start on their hosts, from their agents

    def _monitor_config(self) -> MonitorConfig:
        base = super()._monitor_config()
        return MonitorConfig(**{**base.__dict__, "rank_hosts": self._host_of})

    def _monitor(self, channel: DriverChannel, sinks: list[LogSink]) -> JobMonitor:
        self._agents.attach(channel)
        return ElasticMonitor(
            self._monitor_config(), channel.events, sinks, stop_all=self._stop_all,
            on_custom=lambda event: self._agents.on_custom(event, self._channel_size()),
            policy=self.elastic.policy, reform=self._reform, free_slots=self._free_slots,
            holds_state=self._holds_state, leaving=lambda: set(self._leaving),
        )

    def _launch(self, wid: int, own: dict[str, str], template: warm.Template | None) -> None:
        assert self._job is not None
        with self._lock:
            host = self._initial[wid] if wid < len(self._initial) else self._free_host()
            self._host_of.append(host)
        if is_local(host):
            self._agents.local.add(host)
        env = plan_env(os.environ, self.hosts.forward_env, self.hosts.interfaces, self.spec.env)
        plan = AgentPlan(job=self._job, hosts=(host,) * self._channel_size(), ranks=(wid,),
                         command=self.spec.command, env=env, cwd=os.getcwd(), python=self._python,
                         teardown_grace_s=self.spec.teardown_grace_s, over=own,
                         modules={} if host in self._agents.local else self._modules)
        proc = self._agents.start(host, plan)
        self._agent_of[wid] = proc
        self._procs.append(proc)
        self._threads.extend(self._agents.threads[-2:])
        log.debug("elastic worker %d on host %s", wid, host)

    def _running(self, alive: list[int]) -> dict[str, int]:
        counts = dict.fromkeys(self._usable(), 0)
        for wid in alive:
            if self._host_of[wid] in counts:
                counts[self._host_of[wid]] += 1
        return counts

    def _usable(self) -> dict[str, int]:
        return {h: n for h, n in self._slots.items() if h not in self._down}

    def _free_host(self) -> str:
        alive = [w for w in range(len(self._host_of)) if w not in self._leaving and not self._ended(w)]
        running = self._running(alive)
        free = [h for h, n in self._usable().items() if running[h] < n]
        if not free:
            raise PhalanxError(f"elastic job: no host has a free slot for a replacement (slots {self._usable()}, "
                               f"running {running})")
        return free[0]

    def _ended(self, wid: int) -> bool:
        return self._agents.exits.reported([wid])

    def _free_slots(self, alive: list[int]) -> int:
        with self._lock:
            running = self._running(alive)
            capacity = sum(max(0, n - running[h]) for h, n in self._usable().items())
            return max(0, min(self._target - len(alive), capacity))

    def _reform(self, alive: list[int], size: int) -> list[int]:
        with self._lock:
            kept = alive[:size]
            extra = min(size - len(kept), self._free_slots(kept))
            return super()._reform(kept, len(kept) + extra)

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
            self._target = max(1, min(usable, self.elastic.policy.max_np))
        assert self._channel is not None
        self._channel.events.put(HostsUpdated(usable))

    def _check_joined(self, hosts: dict[str, int]) -> None:
        # A host that joins (or comes back) gets the start-up check before any worker goes there, within the
        # start timeout; one that fails stays out of the job, as Horovod blacklists a host whose workers fail.
        with self._lock:
            known = set(self._slots) | self._down
        joined = [h for h in hosts if h not in known and not is_local(h)]
        problems = host_problems(joined, self.hosts.ssh, self._python, self.spec.start_timeout_s)
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
            self._target = max(1, min(self._target, usable))
        assert self._channel is not None
        self._channel.events.put(HostsUpdated(usable))  # the monitor re-forms without the host's workers now

    def _retire_excess(self) -> None:
        alive = [w for w in range(len(self._host_of)) if w not in self._leaving and not self._ended(w)]
        usable = self._usable()
        kept: dict[str, int] = {}
        for wid in alive:
            host = self._host_of[wid]
            kept[host] = kept.get(host, 0) + 1
            if kept[host] > usable.get(host, 0):
                log.warning("elastic job: stopping worker %d on host %s (the host left the job or has fewer slots)",
                            wid, host)
                self._leaving.add(wid)
                self._agents.retire(self._agent_of[wid])

    def _stop_all(self, grace_s: float | None = None) -> None:
        self._agents.stop(self.spec.teardown_grace_s if grace_s is None else grace_s)
        super()._stop_all(grace_s)
