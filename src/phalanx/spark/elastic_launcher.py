"""An elastic barrier stage: a worker that dies while its executor lives is replaced in its own slot.

Each barrier task is a *slot*. Its first worker's id is the slot number; the task supervises it and, when
it dies (an exception, SIGKILL, the OOM killer), reports the exit and waits on its control connection.
The driver's :class:`~phalanx.job.elastic.ElasticMonitor` asks the pure policy; to re-form, this launcher
sends ``{"spawn": worker_id}`` to the slot's task (which starts the replacement, forked from a warm-start
template when its python worker has one) and publishes the next round in the store it hosts, exactly as
the local launcher does. The survivors roll back to their last commit and re-join; the replacement gets
the state from rank 0 through ``sync()``. When Spark fails the stage itself (a lost executor), the job
fails with a ``SparkJobError`` and :func:`phalanx.spark.run_elastic` submits it again from the last
durable commit.
"""

from __future__ import annotations

import json
import logging
from dataclasses import replace
from typing import TYPE_CHECKING

from phalanx.env import JobContract
from phalanx.env import elastic as elastic_keys
from phalanx.job.channel import DriverChannel, Role
from phalanx.job.elastic import ElasticMonitor
from phalanx.job.logs import LogSink
from phalanx.job.monitor import JobMonitor
from phalanx.launch.elastic import ElasticSpec, publish_round, worker_id_budget
from phalanx.launch.rendezvous import RendezvousStore
from phalanx.spark.launcher import SparkJobSpec, SparkLauncher
from phalanx.spark.task import TaskSpec

if TYPE_CHECKING:
    from pyspark import SparkContext

log = logging.getLogger(__name__)


class ElasticSparkLauncher(SparkLauncher):
    """A :class:`SparkLauncher` whose lost workers are replaced in their slots while the policy allows.

    Args:
        spec: the job (``np`` slots).
        sc: the SparkContext.
        elastic: the policy and the workers' round timeout.
    """

    def __init__(self, spec: SparkJobSpec, sc: SparkContext, elastic: ElasticSpec) -> None:
        super().__init__(spec, sc)
        self.elastic = elastic
        #: The slot (barrier task) of every worker id started so far.
        self.slot_of: list[int] = list(range(spec.np))
        self._store: RendezvousStore | None = None
        self._round = -1
        self._elastic_monitor: ElasticMonitor | None = None

    @property
    def resets(self) -> int:
        """Re-formations so far."""
        return self._elastic_monitor.resets if self._elastic_monitor is not None else 0

    def _channel_size(self) -> int:
        return worker_id_budget(self.spec.np, self.elastic.policy.reset_limit)

    def _monitor(self, channel: DriverChannel, sinks: list[LogSink]) -> JobMonitor:
        self._elastic_monitor = ElasticMonitor(
            self._monitor_config(), channel.events, sinks, stop_all=self._stop_all,
            on_custom=self._on_custom, policy=self.elastic.policy, reform=self._reform,
            free_slots=self._free_slots, holds_state=self._holds_state, give_up=self._give_up,
            progress=self.progress, on_tick=lambda: self._count_tasks(channel),
        )
        return self._elastic_monitor

    def _prepare(self, store: RendezvousStore) -> None:
        self._store = store
        self._publish(list(range(self.spec.np)))

    def _task_spec(self, job: JobContract) -> TaskSpec:
        return replace(super()._task_spec(job), elastic_timeout_s=self.elastic.timeout_s,
                       worker_ids=self._channel_size())

    def _succeeded(self) -> None:
        # Tasks whose worker was lost and not replaced wait for a command: the job is over, release them.
        if self._channel is not None:
            self._channel.abort_all()

    def _unfinished(self) -> list[int]:
        with self._exits.lock:
            return [w for w in range(len(self.slot_of)) if w not in self._exits.exited]

    def _give_up(self) -> str:
        if self.spark_error is None:
            return ""
        return "Spark failed the barrier stage (a lost executor or task), so no slot can host a replacement"

    def _holds_state(self, worker: int) -> bool:
        if worker < self.spec.np:  # the first world: the user's initial state (or the durable checkpoint)
            return True
        assert self._store is not None
        return self._store.check(elastic_keys.synced_key(self._round, worker))

    def _free_slots(self, alive: list[int]) -> int:
        if self.spark_error is not None:
            return 0
        return self.spec.np - len({self.slot_of[w] for w in alive})

    def _reform(self, alive: list[int], size: int) -> list[int]:
        busy = {self.slot_of[w] for w in alive}
        world = alive[:size]
        for slot in [s for s in range(self.spec.np) if s not in busy][: max(0, size - len(world))]:
            worker = len(self.slot_of)
            if worker >= self._channel_size():
                log.warning("elastic job used all %d worker ids; slot %d stays empty", worker, slot)
                break
            assert self._channel is not None
            if self._channel.command(slot, Role.SUPERVISOR, json.dumps({"spawn": worker}).encode()):
                self.slot_of.append(slot)
                world.append(worker)
            else:
                log.warning("the task of slot %d is gone; it cannot host a replacement", slot)
        self._publish(world)
        log.info("elastic round %d: workers %s in slots %s", self._round, world, [self.slot_of[w] for w in world])
        return world

    def _publish(self, world: list[int]) -> None:
        assert self._store is not None
        self._round += 1
        publish_round(self._store, self._round, world)
