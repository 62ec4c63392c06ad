"""The task of a Spark Connect job: ``mapInArrow(task, SCHEMA, barrier=True)``, one per rank.

Rank 0's task hosts the job (channel, rendezvous store, monitor: :mod:`phalanx.spark.connect.host`)
before the barrier's single ``allGather`` round, so every task learns from that round each task's host
and GPUs and where the job's channel and store are. From there each task supervises its rank exactly as
a classic task does (:func:`phalanx.spark.task.supervise`). Every task returns a status row; rank 0's also
returns the job's signed outcome, in chunks (:mod:`phalanx.spark.connect.wire`).
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from phalanx.env import JobContract, settings
from phalanx.launch.core import JobSpec
from phalanx.launch.elasticity import ElasticSpec
from phalanx.launch.supervisor import EXIT_NOT_STARTED
from phalanx.spark.connect import wire as connect_wire
from phalanx.spark.connect.host import HostedJob, probe_client
from phalanx.spark.launcher import task_spec as launcher_task_spec
from phalanx.spark.task import done, prestart, supervise_task, task_host, task_resources, warm_early


@dataclass(frozen=True)
class ConnectTaskSpec:
    """What every task of a Connect job needs; pickled with the task function.

    Attributes:
        job: the job (without the client's output streams).
        run_id: the job's id.
        elastic: the elastic policy, or None for a plain job.
        client: ``host:port`` of the client's log link ("" for none).
        secret: the client's per-job secret: authenticates the log link and signs the outcome.
        probe_s: seconds rank 0's task tries to reach the client's log link.
    """

    job: JobSpec
    run_id: str
    elastic: ElasticSpec | None
    client: str
    secret: str
    probe_s: float


def _host_address(ctx: Any) -> str:
    """The address Spark reaches rank 0's executor at (``BarrierTaskInfo.address`` is ``host:port``)."""
    return str(ctx.getTaskInfos()[0].address).rpartition(":")[0] or task_host()


def _start_host(spec: ConnectTaskSpec, ctx: Any) -> tuple[HostedJob | None, dict[str, Any]]:
    """Rank 0: host the job; return the host and what the other tasks must learn (or the failure)."""
    host = HostedJob(spec.job, spec.run_id, spec.elastic)
    try:
        job = host.host(_host_address(ctx))
    except OSError as e:
        return None, {"failed": f"rank 0's task could not host the job's channel and store: {e}"}
    threading.Thread(target=probe_client, args=(host.relay, spec.client, spec.secret, spec.probe_s),
                     name="phalanx-probe", daemon=True).start()
    return host, {"channel": job.channel, "secret": job.secret, "addr": job.master_addr, "port": job.master_port}


def _contract(spec: ConnectTaskSpec, hosted: dict[str, Any]) -> JobContract:
    return JobContract(run_id=spec.run_id, master_addr=str(hosted["addr"]), master_port=int(hosted["port"]),
                       channel=str(hosted["channel"]), secret=str(hosted["secret"]),
                       start_timeout_s=spec.job.start_timeout_s)


def _run_ranks(spec: ConnectTaskSpec, task: int, gathered: list[dict[str, Any]]) -> list[bytes]:
    """Run this task's ranks; return their status bodies."""
    hosted = gathered[0].get("job") or {"failed": "rank 0's task sent no job address"}
    per_task = spec.job.ranks_per_task
    if "failed" in hosted:
        return [connect_wire.status_body(rank, EXIT_NOT_STARTED, False, str(hosted["failed"]))
                for rank in range(task * per_task, (task + 1) * per_task)]
    # The template started with this task (_warm_early) imports what a cold rank would: wait for it.
    task_spec = warm_early(launcher_task_spec(spec.job, _contract(spec, hosted), spec.elastic))
    hosts, gpus = [g["host"] for g in gathered], [g["gpus"] for g in gathered]
    try:
        statuses = supervise_task(task_spec, task, hosts, gpus, gathered[task].get("problem", ""))
    finally:
        done(task_spec)
    return [connect_wire.status_body(int(s["rank"]), int(s["exit"]), bool(s["reported"]), s.get("error") or "")
            for s in map(json.loads, statuses)]


def _warm_early(job: JobSpec) -> None:
    """Start this executor's warm-start template now, when the job's ranks may fork from one and none runs:
    its imports then overlap the barrier round, and the rank forks from it (it waits for its imports up to
    ``warm.READY_WAIT_S``, else starts cold) instead of paying them after the round."""
    if job.command is None and job.warm_preload is not None and settings.WARM_START.get(job.env):
        prestart(job.warm_preload)


def connect_task(spec: ConnectTaskSpec) -> Callable[[Iterator[Any]], Iterator[Any]]:
    """The function to pass to ``mapInArrow(..., barrier=True)``: it supervises this task's rank."""

    def task(batches: Iterator[Any]) -> Iterator[Any]:
        from pyspark import BarrierTaskContext

        for _ in batches:  # the input is one row per task; the rank is the partition id
            pass
        _warm_early(spec.job)
        ctx = BarrierTaskContext.get()
        task_id = ctx.partitionId()
        mine = task_resources(dict(ctx.resources()))
        host = None
        if task_id == 0:
            host, mine["job"] = _start_host(spec, ctx)
        gathered = [json.loads(m) for m in ctx.allGather(json.dumps(mine))]
        for rank, status in enumerate(_run_ranks(spec, task_id, gathered), task_id * spec.job.ranks_per_task):
            yield from connect_wire.rows(rank, connect_wire.STATUS, status)
        if host is not None:
            yield from connect_wire.rows(0, connect_wire.OUTCOME, connect_wire.sign(host.finish(), spec.secret))

    return task
