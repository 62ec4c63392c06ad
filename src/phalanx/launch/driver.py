"""One job's driver: the channel, the rendezvous store and the monitor around composed parts.

Every launcher is the same :class:`JobDriver` with other parts (torchelastic's split of the agent from its
``PContext``, Lightning Fabric's ``_Launcher``):

- a :class:`~phalanx.launch.core.JobSpec`: what runs;
- a :class:`RankStarter`: where the ranks start and how they are stopped: forks of this process
  (:class:`~phalanx.launch.local.LocalForks`), host agents (:class:`~phalanx.launch.remote.HostAgents`,
  :class:`~phalanx.launch.elastic_hosts.ElasticHostAgents`), the tasks of a Spark barrier stage
  (:class:`~phalanx.spark.launcher.SparkBarrierStage`) or of the stage the driver itself runs in
  (:class:`~phalanx.spark.connect.host.HostedStage`);
- optionally an elastic part (:class:`~phalanx.launch.elasticity.Elasticity`): lost workers are replaced and the world
  re-forms, through the starter's :class:`~phalanx.launch.elasticity.Replacer` side.

The driver owns the order of a job's life: services up, ranks started, the monitor's verdict, then (on any
exit) the ranks stopped, the event queue closed, the starter closed, the services closed.
"""

from __future__ import annotations

import logging
import queue
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

from phalanx.env import JobContract
from phalanx.job.channel import Custom, DriverChannel
from phalanx.job.logs import LogSink
from phalanx.job.monitor import JobMonitor, MonitorConfig
from phalanx.job.progress import Progress
from phalanx.launch.core import JobSpec, monitor_config, new_run_id
from phalanx.launch.rendezvous import RendezvousStore
from phalanx.observe import open_watch

log = logging.getLogger(__name__)


class RankStarter(Protocol):
    """Where a job's ranks start, and how they are stopped (one per job; the driver calls it in this order:
    :meth:`start` once, :meth:`stop` any number of times from any thread, :meth:`close` once)."""

    def start(self, job: JobContract, channel: DriverChannel) -> None:
        """Start the ranks (worker ids ``0..np-1``) with the job's contract; their output, results and ends
        reach ``channel.events``."""

    def stop(self, grace_s: float) -> None:
        """Stop every rank (SIGTERM, ``grace_s``, SIGKILL, wherever they run); idempotent."""

    def unfinished(self) -> list[int]:
        """The worker ids started whose end was not seen yet."""

    def close(self) -> None:
        """The job is judged and its event queue closed: reap what is left and release the starter's threads."""


class ElasticPart(Protocol):
    """What the driver asks of a job's elastic part (:class:`~phalanx.launch.elasticity.Elasticity`)."""

    @property
    def channel_size(self) -> int:
        """How many worker ids the channel and the store accept."""

    def begin(self, store: RendezvousStore) -> None:
        """Publish the first world in the job's store, before any worker starts."""

    def monitor(self, config: MonitorConfig, events: queue.Queue[Any], sinks: Sequence[LogSink],
                stop_all: Callable[[], None], on_custom: Callable[[Custom], None] | None = None,
                progress: Progress | None = None, on_tick: Callable[[], None] | None = None) -> JobMonitor:
        """The job's monitor, which re-forms the world on a loss while the policy allows."""


@dataclass(frozen=True)
class DriverAddress:
    """Where the channel and the store listen (``bind``) and the address the ranks reach them at."""

    bind: str
    advertise: str

    @classmethod
    def loopback(cls) -> DriverAddress:
        """This machine only."""
        return cls("127.0.0.1", "127.0.0.1")


@dataclass
class JobDriver:
    """Runs one job: :meth:`run` once (or :meth:`open`, :meth:`judge` and :meth:`close` for a driver that
    runs inside the stage it drives).

    Attributes:
        spec: the job.
        starter: where its ranks start.
        address: where the channel and the store listen.
        sinks: where the ranks' log lines go.
        run_id: the job's id.
        elasticity: lost workers are replaced (None: a lost rank fails the job).
        on_custom: the starter's EVENT frames (its supervisors' exit reports, heartbeats, messages).
        progress: tells what the start waits for.
        on_tick: called in the monitor's thread at every poll (the starter counts what it started).
        rank_hosts: each worker's host, for the monitor's messages (may grow while the job runs).
        raw_results: the monitor keeps results pickled (they travel on, to a Connect client).
        watch_title: how the job's live page names it.
        stop_reaps_s: on every end, stop what is left of the ranks with this grace (None: only on failure).
        sweep_shm: the ranks ran on this host: remove the shared-memory files that killed ranks left.
    """

    spec: JobSpec
    starter: RankStarter
    address: DriverAddress
    sinks: Sequence[LogSink]
    run_id: str = field(default_factory=new_run_id)
    elasticity: ElasticPart | None = None
    on_custom: Callable[[Custom], None] | None = None
    progress: Progress | None = None
    on_tick: Callable[[], None] | None = None
    rank_hosts: Sequence[str] = ()
    raw_results: bool = False
    watch_title: str = "job"
    stop_reaps_s: float | None = None
    sweep_shm: bool = False
    channel: DriverChannel | None = field(init=False, default=None)
    store: RendezvousStore | None = field(init=False, default=None)

    @property
    def channel_size(self) -> int:
        """How many worker ids the channel and the store accept (an elastic job needs more than np)."""
        return self.elasticity.channel_size if self.elasticity is not None else self.spec.np

    def run(self, before_start: Callable[[], None] | None = None) -> list[Any]:
        """Run the job to its end; return each rank's value (None for commands) in rank order.

        Args:
            before_start: called once the services are up, before the ranks start.

        Raises:
            WorkerFailedError: a rank failed (root cause first).
            StartTimeoutError: ranks did not start in time.
        """
        watch = open_watch(self.spec.observe, self.run_id, self.spec.np, self.watch_title)
        try:
            job, monitor = self.open()
            monitor.observer = watch.observe if watch is not None else None
            try:
                if before_start is not None:
                    before_start()
                assert self.channel is not None
                self.starter.start(job, self.channel)
                return self.judge(monitor)
            except BaseException:
                if self.progress is not None:
                    self.progress.finish()  # Ctrl-C during the start: its one line goes on a line of its own
                self.stop()  # Ctrl-C, or an error of our own: stop the ranks now, not after a wait
                raise
            finally:
                if self.stop_reaps_s is not None:
                    self.starter.stop(self.stop_reaps_s)
                self.close()
        finally:
            if watch is not None:
                watch.close()

    def open(self) -> tuple[JobContract, JobMonitor]:
        """Open the channel and the store; return the job's contract and its monitor (not running yet)."""
        channel = DriverChannel(self.channel_size, self.spec.payload, bind_host=self.address.bind,
                                advertise_host=self.address.advertise)
        self.channel = channel
        try:
            self.store = RendezvousStore(self.channel_size, channel.secret, bind_host=self.address.bind)
        except BaseException:
            channel.close()
            raise
        job = JobContract(run_id=self.run_id, master_addr=self.address.advertise, master_port=self.store.port,
                          channel=channel.address, secret=channel.secret, start_timeout_s=self.spec.start_timeout_s)
        if self.elasticity is not None:
            self.elasticity.begin(self.store)
        return job, self._monitor(channel)

    def judge(self, monitor: JobMonitor) -> list[Any]:
        """Run the monitor to the job's verdict; return the values."""
        return monitor.run()

    def stop(self, grace_s: float | None = None) -> None:
        """Stop every rank (the monitor's stop, on the first failure; idempotent)."""
        self.starter.stop(self.spec.teardown_grace_s if grace_s is None else grace_s)

    def close(self) -> None:
        """The job is judged: close the event queue (readers of the ranks' output must not block any more),
        the starter, the channel and the store."""
        channel, store = self.channel, self.store
        if channel is not None:
            channel.events.close()
        self.starter.close()
        if channel is not None:
            channel.close()
        if store is not None:
            if self.sweep_shm:
                _remove_leftovers(store)
            store.close()

    def _config(self) -> MonitorConfig:
        config = monitor_config(self.spec.np, self.spec.command is None, self.spec.start_timeout_s,
                                self.spec.start_timeout_hint, self.spec.teardown_grace_s)
        return replace(config, rank_hosts=self.rank_hosts, raw_results=self.raw_results)

    def _monitor(self, channel: DriverChannel) -> JobMonitor:
        if self.elasticity is not None:
            return self.elasticity.monitor(self._config(), channel.events, self.sinks, stop_all=self.stop,
                                           on_custom=self.on_custom, progress=self.progress, on_tick=self.on_tick)
        return JobMonitor(self._config(), channel.events, self.sinks, stop_all=self.stop,
                          on_custom=self.on_custom, progress=self.progress, on_tick=self.on_tick)


def _remove_leftovers(store: RendezvousStore) -> None:
    """The ranks are gone: shared-memory files a rank killed during its transport's set-up left on this host
    are removed now (their names are in the store), not by some later job's sweep."""
    removed = store.remove_shm_leftovers()
    if removed:
        log.debug("removed shared-memory files left by killed ranks: %s", removed)
