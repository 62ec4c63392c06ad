"""Elastic local jobs: a lost worker is replaced and the world re-forms instead of the job failing.

Each process is a *worker* with a stable id (its channel rank, ``PHALANX_ELASTIC_WORKER_ID``); its torch
rank comes from the round the driver publishes in the store it hosts (``phalanx.env.elastic``).
Round 0 is workers ``0..np-1``; after a loss the survivors keep their order and replacements (new ids)
fill the free slots, up to ``np`` (``max_np`` caps it, ``min_np`` is the floor).
"""

from __future__ import annotations

import logging
import os
import socket
import time
from dataclasses import dataclass
from typing import Any

from phalanx.env import JobContract, RankIdentity, compose_env, worker_env
from phalanx.env import elastic as elastic_keys
from phalanx.env import names as env_names
from phalanx.errors import PhalanxError
from phalanx.job.channel import DriverChannel
from phalanx.job.elastic import ElasticMonitor, ElasticPolicy, HostsUpdated
from phalanx.job.logs import LogSink
from phalanx.job.monitor import JobMonitor
from phalanx.launch import warm
from phalanx.launch.discovery import HostDiscovery, local_slots
from phalanx.launch.fr_dump import DumpDir
from phalanx.launch.local import LocalJobSpec, LocalLauncher
from phalanx.launch.rendezvous import RendezvousStore

log = logging.getLogger(__name__)

def publish_round(store: RendezvousStore, round_no: int, world: list[int]) -> None:
    """Publish round ``round_no`` (worker ids in rank order) in the driver's store."""
    for key, value in elastic_keys.round_plan(round_no, world):
        store.set(key, value)
    log.debug("published elastic round %d: workers %s", round_no, world)


def worker_id_budget(np: int, reset_limit: int | None) -> int:
    """How many worker ids an elastic job of ``np`` workers may use: the first world plus one replacement
    per worker per reset (100 resets when there is no limit)."""
    return np * (1 + (reset_limit if reset_limit is not None else 100))


@dataclass(frozen=True)
class ElasticSpec:
    """The elastic part of a local job.

    Attributes:
        policy: min_np, max_np, reset_limit.
        timeout_s: seconds a worker waits for a round and for one collective (``PHALANX_ELASTIC_TIMEOUT_S``).
        discovery_script: prints ``host:slots`` lines; polled to grow the world up to ``max_np``.
        slots_per_host: the slots of a discovery line that names a host alone (``--slots-per-host``).
    """

    policy: ElasticPolicy
    timeout_s: float = elastic_keys.DEFAULT_ELASTIC_TIMEOUT_S
    discovery_script: str | None = None
    slots_per_host: int = 1


class ElasticLocalLauncher(LocalLauncher):
    """A :class:`LocalLauncher` whose lost workers are replaced while the policy allows."""

    def __init__(self, spec: LocalJobSpec, elastic: ElasticSpec) -> None:
        super().__init__(spec)
        self.elastic = elastic
        self._job: JobContract | None = None
        self._store: RendezvousStore | None = None
        self._channel: DriverChannel | None = None
        self._round = -1
        self._target = min(spec.np, elastic.policy.max_np)
        self._first = self._target  # worker ids below this are the first world's
        self._discovery: HostDiscovery | None = None
        self._warned: set[str] = set()
        self._next_id = 0

    def run(self) -> list[Any]:
        """Run the job (see :meth:`LocalLauncher.run`), polling the host discovery script if there is one."""
        try:
            return super().run()
        finally:
            if self._discovery is not None:
                self._discovery.stop()

    def _channel_size(self) -> int:
        # Every worker id ever used: the first world plus one replacement per worker per reset.
        most = self.elastic.policy.max_np if self.elastic.discovery_script else self._first
        return worker_id_budget(most, self.elastic.policy.reset_limit)

    def _on_hosts(self, hosts: dict[str, int]) -> None:
        # In the discovery thread: replacements fill up to the discovered slots from now on; the monitor grows.
        self._on_slots(local_slots(hosts, self._warned))

    def _on_slots(self, slots: int) -> None:
        self._target = max(1, min(slots, self.elastic.policy.max_np))
        assert self._channel is not None
        self._channel.events.put(HostsUpdated(slots))

    def _monitor(self, channel: DriverChannel, sinks: list[LogSink]) -> JobMonitor:
        return ElasticMonitor(
            self._monitor_config(), channel.events, sinks, stop_all=self._stop_all,
            policy=self.elastic.policy, reform=self._reform, free_slots=self._free_slots,
            holds_state=self._holds_state,
        )

    def _start(self, channel: DriverChannel, store: RendezvousStore) -> None:
        self._job = self._contract(channel, store)
        self._store, self._channel = store, channel
        template = self._template()
        for _ in range(self._target):
            self._spawn_worker(template)
        self._publish(list(range(self._target)))
        log.debug("started elastic job: %d workers", self._target)
        if self.elastic.discovery_script:
            self._discovery = HostDiscovery(self.elastic.discovery_script, self._on_hosts,
                                            default_slots=self.elastic.slots_per_host)
            self._discovery.start()

    def _spawn_worker(self, template: warm.Template | None) -> int:
        assert self._job is not None
        wid = self._next_id
        if wid >= self._channel_size():
            raise PhalanxError(f"elastic job used all {self._channel_size()} worker ids; raise reset_limit")
        self._next_id += 1
        own = {env_names.PHALANX_ELASTIC_WORKER_ID: str(wid),
               env_names.PHALANX_ELASTIC_TIMEOUT_S: f"{self.elastic.timeout_s:g}",
               env_names.LOCAL_WORLD_SIZE: str(self._target)}  # OpenMP threads: cores / live workers
        self._launch(wid, own, template)
        return wid

    def _launch(self, wid: int, own: dict[str, str], template: warm.Template | None) -> None:
        """Start worker ``wid`` here with the elastic variables ``own`` laid over its contract."""
        assert self._job is not None and self._channel is not None
        size = self._channel_size()
        who = RankIdentity(rank=wid, size=size, local_rank=wid, local_size=size, cross_rank=0, cross_size=1,
                           host_rank=0, host_count=1, hostname=socket.gethostname())
        own = {env_names.PHALANX_PARENT_PID: str(os.getpid()), **own}
        env = compose_env(os.environ, self.spec.env, {**worker_env(self._job, who), **own}, os.cpu_count())
        dumps = DumpDir.create(env)
        proc = self._spawn({**env, **dumps.env()}, template)
        self._procs.append(proc)
        self._watch(wid, proc, self._channel, dumps)

    def _publish(self, world: list[int]) -> None:
        assert self._store is not None
        self._round += 1
        publish_round(self._store, self._round, world)

    def _holds_state(self, worker: int) -> bool:
        if worker < self._first:  # the first world: the user's initial state (or the durable checkpoint)
            return True
        assert self._store is not None
        return self._store.check(elastic_keys.synced_key(self._round, worker))

    def _free_slots(self, alive: list[int]) -> int:
        return max(0, self._target - len(alive))

    def _reform(self, alive: list[int], size: int) -> list[int]:
        started = time.monotonic()
        template = self._template()
        world = alive[:size] + [self._spawn_worker(template) for _ in range(max(0, size - len(alive)))]
        self._publish(world)
        log.info("elastic round %d: workers %s (re-formed in %.2f s)", self._round, world,
                 time.monotonic() - started)
        return world
