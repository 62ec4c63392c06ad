"""A job's elastic part (:class:`Elasticity`), and elastic local jobs: a lost worker is replaced and the world
re-forms instead of the job failing.

Each process is a *worker* with a stable id (its channel rank, ``PHALANX_ELASTIC_WORKER_ID``); its torch
rank comes from the round the driver publishes in the store it hosts (``phalanx.env.rounds``).
Round 0 is workers ``0..np-1``; after a loss the survivors keep their order and replacements (new ids)
fill the free slots, up to ``np`` (``max_np`` caps it, ``min_np`` is the floor).

The elastic part of every launcher is one composed :class:`Elasticity`; what differs is how its
:class:`Replacer` starts a replacement: a fork here (:class:`ElasticForks`), an agent on a host with a
free slot (:class:`~phalanx.launch.elastic_hosts.ElasticHostAgents`), a command to a barrier task whose worker
was lost (:class:`~phalanx.spark.launcher.TaskSlots`).
"""

from __future__ import annotations

import logging
import queue
import socket
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from phalanx.env import JobContract, RankIdentity
from phalanx.env import names as env_names
from phalanx.env import rounds as elastic_keys
from phalanx.errors import PhalanxError
from phalanx.job.channel import Custom, DriverChannel
from phalanx.job.elastic_policy import ElasticMonitor, ElasticPolicy, HostsUpdated
from phalanx.job.logs import LogSink
from phalanx.job.monitor import MonitorConfig
from phalanx.job.progress import Progress
from phalanx.launch import warm
from phalanx.launch.core import JobSpec, new_run_id
from phalanx.launch.discovery import HostDiscovery, local_slots
from phalanx.launch.driver import DriverAddress
from phalanx.launch.local import LocalForks, observed, run_on_driver
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


def elastic_env(wid: int, elastic: ElasticSpec, target: int, budget: int) -> dict[str, str]:
    """The variables of worker ``wid`` of a driver-side elastic job over its contract (``LOCAL_WORLD_SIZE``, the
    target size, sizes its OpenMP threads: cores / live workers).

    Raises:
        PhalanxError: ``wid`` is beyond the job's ``budget`` of worker ids.
    """
    if wid >= budget:
        raise PhalanxError(f"elastic job used all {budget} worker ids; raise reset_limit")
    return {env_names.PHALANX_ELASTIC_WORKER_ID: str(wid),
            env_names.PHALANX_ELASTIC_TIMEOUT_S: f"{elastic.timeout_s:g}",
            env_names.LOCAL_WORLD_SIZE: str(target)}


def poll_discovery(elastic: ElasticSpec, on_hosts: Callable[[dict[str, int]], None]) -> HostDiscovery | None:
    """Start polling the job's host discovery script (``on_hosts`` gets each listing, in the poller's thread);
    None when the job has no script."""
    if not elastic.discovery_script:
        return None
    discovery = HostDiscovery(elastic.discovery_script, on_hosts, default_slots=elastic.slots_per_host)
    discovery.start()
    return discovery


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


class Replacer(Protocol):
    """What an elastic job's rank starter does beyond :class:`~phalanx.launch.driver.RankStarter`: replace lost
    workers (with new worker ids)."""

    def add(self, kept: list[int], count: int) -> list[int]:
        """Start up to ``count`` replacements beside the workers ``kept``; return their worker ids (called in
        the monitor's thread)."""

    def free_slots(self, alive: list[int]) -> int:
        """How many replacements could start now, given the alive worker ids."""

    def give_up(self) -> str:
        """A reason to fail instead of re-forming, whatever the policy says; empty when there is none."""

    def leaving(self) -> set[int]:
        """The worker ids being stopped because their host left the job."""


class Elasticity:
    """The elastic part of a job's driver: the policy, the rounds it publishes in the store, and the
    re-formations, which start replacements through the job's :class:`Replacer`.

    Args:
        spec: the policy and the workers' round timeout.
        starter: starts (and replaces) the workers.
        first: the first world's size (workers ``0..first-1``, which hold the user's initial state).
        most: the most workers at once (sizes the worker ids: :func:`worker_id_budget`).
    """

    def __init__(self, spec: ElasticSpec, starter: Replacer, first: int, most: int) -> None:
        self.spec = spec
        self.starter = starter
        self.first = first
        self.channel_size = worker_id_budget(most, spec.policy.reset_limit)
        self._store: RendezvousStore | None = None
        self._round = -1
        self._monitor: ElasticMonitor | None = None

    @property
    def resets(self) -> int:
        """Re-formations so far."""
        return self._monitor.resets if self._monitor is not None else 0

    def begin(self, store: RendezvousStore) -> None:
        """Publish round 0 (the first world) in the job's store, before any worker starts."""
        self._store = store
        self._publish(list(range(self.first)))

    def monitor(self, config: MonitorConfig, events: queue.Queue[Any], sinks: Sequence[LogSink],
                stop_all: Callable[[], None], on_custom: Callable[[Custom], None] | None = None,
                progress: Progress | None = None, on_tick: Callable[[], None] | None = None) -> ElasticMonitor:
        """The job's monitor: it asks the policy on every loss and calls back here to re-form."""
        starter = self.starter
        self._monitor = ElasticMonitor(
            config, events, sinks, stop_all=stop_all, on_custom=on_custom, progress=progress, on_tick=on_tick,
            policy=self.spec.policy, reform=self._reform, free_slots=starter.free_slots,
            holds_state=self._holds_state, give_up=starter.give_up, leaving=starter.leaving,
        )
        return self._monitor

    def _holds_state(self, worker: int) -> bool:
        if worker < self.first:  # the first world: the user's initial state (or the durable checkpoint)
            return True
        assert self._store is not None
        return self._store.check(elastic_keys.synced_key(self._round, worker))

    def _reform(self, alive: list[int], size: int) -> list[int]:
        started = time.monotonic()
        kept = alive[:size]
        world = kept + self.starter.add(kept, max(0, size - len(kept)))
        self._publish(world)
        log.info("elastic round %d: workers %s (re-formed in %.2f s)", self._round, world,
                 time.monotonic() - started)
        return world

    def _publish(self, world: list[int]) -> None:
        assert self._store is not None
        self._round += 1
        publish_round(self._store, self._round, world)


class ElasticForks:
    """The workers of an elastic job on this machine (a rank starter and a :class:`Replacer`):
    :class:`LocalForks` started one worker id at a time, the world's target size following the host discovery
    script when there is one.

    Args:
        spec: the job.
        elastic: the policy and the discovery script.
        run_id: the job's id.
    """

    def __init__(self, spec: JobSpec, elastic: ElasticSpec, run_id: str, progress: Progress | None = None) -> None:
        self.spec = spec
        self.elastic = elastic
        self.forks = LocalForks(spec, run_id, progress)
        self.target = min(spec.np, elastic.policy.max_np)
        #: The most workers at once: the policy's, when discovery may grow the world, else the first world's.
        self.most = elastic.policy.max_np if elastic.discovery_script else self.target
        self.channel_size = worker_id_budget(self.most, elastic.policy.reset_limit)
        self._channel: DriverChannel | None = None
        self._discovery: HostDiscovery | None = None
        self._warned: set[str] = set()
        self._next_id = 0

    def start(self, job: JobContract, channel: DriverChannel) -> None:
        """Start the first world (workers ``0..target-1``), then poll the discovery script if there is one."""
        self._channel = channel
        self.forks.attach(job, channel)
        template = self.forks.template()
        for _ in range(self.target):
            self._spawn(template)
        log.debug("started elastic job: %d workers", self.target)
        self._discovery = poll_discovery(self.elastic, self._on_hosts)

    def add(self, kept: list[int], count: int) -> list[int]:
        """Fork ``count`` replacements.

        Raises:
            PhalanxError: the job used all its worker ids.
        """
        template = self.forks.template()
        return [self._spawn(template) for _ in range(count)]

    def free_slots(self, alive: list[int]) -> int:
        """Up to the target size."""
        return max(0, self.target - len(alive))

    def give_up(self) -> str:
        """Never: a fork can always be started."""
        return ""

    def leaving(self) -> set[int]:
        """None: this machine does not leave."""
        return set()

    def stop(self, grace_s: float) -> None:
        """See :meth:`LocalForks.stop`."""
        self.forks.stop(grace_s)

    def unfinished(self) -> list[int]:
        """See :meth:`LocalForks.unfinished`."""
        return self.forks.unfinished()

    def close(self) -> None:
        """Stop polling the discovery script; see :meth:`LocalForks.close`."""
        if self._discovery is not None:
            self._discovery.stop()
        self.forks.close()

    def _on_hosts(self, hosts: dict[str, int]) -> None:
        # In the discovery thread: replacements fill up to the discovered slots from now on; the monitor grows.
        self.on_slots(local_slots(hosts, self._warned))

    def on_slots(self, slots: int) -> None:
        """Discovery found ``slots`` slots: the target follows, and the monitor may grow the world."""
        self.target = max(1, min(slots, self.elastic.policy.max_np))
        assert self._channel is not None
        self._channel.events.put(HostsUpdated(slots))

    def _spawn(self, template: warm.Template | None) -> int:
        wid = self._next_id
        own = elastic_env(wid, self.elastic, self.target, self.channel_size)
        self._next_id += 1
        size = self.channel_size
        who = RankIdentity(rank=wid, size=size, local_rank=wid, local_size=size, cross_rank=0, cross_size=1,
                           host_rank=0, host_count=1, hostname=socket.gethostname())
        self.forks.spawn(who, own, template)
        return wid


class ElasticLocalLauncher:
    """A local job whose lost workers are replaced while the policy allows; use :meth:`run` once."""

    def __init__(self, spec: JobSpec, elastic: ElasticSpec) -> None:
        self.spec = observed(spec)
        self.run_id = new_run_id()
        self.progress = Progress(enabled=self.spec.progress)
        self.starter = ElasticForks(self.spec, elastic, self.run_id, self.progress)
        self.elasticity = Elasticity(elastic, self.starter, self.starter.target, self.starter.most)

    def run(self) -> list[Any]:
        """Run the job (see :meth:`~phalanx.launch.local.LocalLauncher.run`)."""
        return run_on_driver(self.spec, self.starter, DriverAddress.loopback(), self.run_id, self.progress,
                             elasticity=self.elasticity)
