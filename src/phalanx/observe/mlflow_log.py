"""Log a job to the driver's active MLflow run (``mlflow=True`` / ``PHALANX_MLFLOW=1``).

Rank 0's figures only (one series, not one per rank), as it reports them (about once a second): steps,
steps/s, seconds per step, seconds waited in collectives and bytes reduced, each at ``step=`` rank 0's step
count. When the job is judged: the job's own figures (ranks, start latency, re-formations, wall time,
success) and the timeline summary as ``phalanx/timeline_summary.json``.

MLflow's calls can block (a remote tracking server), so they run in one thread of their own, fed through a
bounded queue; the monitor's thread only puts. The run is the one active in the thread that starts the job
(MLflow keeps the active run per thread), else the one ``MLFLOW_RUN_ID`` names (``phalanxrun --mlflow``),
addressed by its id through ``MlflowClient``.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

from phalanx.env import names as env_names
from phalanx.job.observation import JobEnded, Observation
from phalanx.job.stats import RankStats
from phalanx.observe.board import JobBoard

log = logging.getLogger(__name__)

#: Records waiting for MLflow at most; more are dropped (and counted in the log), never block the job.
QUEUE = 256
#: Seconds :meth:`MlflowLog.close` waits for MLflow to take what is queued.
CLOSE_WAIT_S = 30.0
PREFIX = "phalanx."


class MlflowLog:
    """Feeds rank 0's records and the job's end to MLflow; see the module docstring.

    Args:
        mlflow: the ``mlflow`` module (a test passes a stand-in).
        board: the job's board (its summary at the end).
    """

    def __init__(self, mlflow: Any, board: JobBoard) -> None:
        active = mlflow.active_run()
        self.run_id: str | None = active.info.run_id if active is not None else os.environ.get(env_names.MLFLOW_RUN_ID)
        if not self.run_id:
            self.run_id = None
            log.warning("phalanx: mlflow=True but no MLflow run is active on the driver: call "
                        "mlflow.start_run() first (or set %s); this job is not logged", env_names.MLFLOW_RUN_ID)
            return
        self._client = mlflow.tracking.MlflowClient()
        self._board = board
        self._last_steps = -1
        self._dropped = 0
        self._queue: queue.Queue[Callable[[], None] | None] = queue.Queue(QUEUE)
        self._thread = threading.Thread(target=self._work, name="phalanx-mlflow", daemon=True)
        self._thread.start()

    def observe(self, obs: Observation) -> None:
        """Take an observation (the monitor's thread): rank 0's records and the job's end."""
        if self.run_id is None:
            return
        if isinstance(obs, RankStats) and obs.rank == 0 and obs.steps != self._last_steps:
            self._last_steps = obs.steps
            self._put(self._rank0(obs))
        elif isinstance(obs, JobEnded):
            self._put(self._ended(obs))

    def _put(self, task: Callable[[], None]) -> None:
        try:
            self._queue.put_nowait(task)
        except queue.Full:
            self._dropped += 1

    def _rank0(self, rec: RankStats) -> Callable[[], None]:
        row = self._board.row(0)
        figures = {"steps": rec.steps, "steps_per_s": row["steps_per_s"], "step_seconds": row["step_s"],
                   "collective_wait_seconds": rec.wait_s, "reduced_bytes": rec.nbytes}
        return lambda: self._log(figures, rec.steps)

    def _ended(self, obs: JobEnded) -> Callable[[], None]:
        snap = self._board.snapshot()
        figures = {"job_ranks": snap["world_size"], "job_reformations": snap["resets"],
                   "job_seconds": snap["uptime_s"], "job_succeeded": 1 if obs.ok else 0}
        if snap["start_latency_s"] is not None:
            figures["job_start_latency_seconds"] = snap["start_latency_s"]
        summary = {"run_id": snap["run_id"], "collectives": snap["summary"], "ok": obs.ok,
                   "report": obs.report[:4000]}

        def task() -> None:
            self._log(figures, None)
            self._client.log_dict(self.run_id, summary, "phalanx/timeline_summary.json")

        return task

    def _log(self, figures: dict[str, float], step: int | None) -> None:
        stamp = int(time.time() * 1000)
        for key, value in figures.items():
            self._client.log_metric(self.run_id, PREFIX + key, float(value), timestamp=stamp, step=step or 0)

    def _work(self) -> None:
        while True:
            task = self._queue.get()
            if task is None:
                return
            try:
                task()
            except Exception as e:  # MLflow down: the job goes on, the user hears once per failure
                log.warning("phalanx: logging to MLflow failed: %s: %s", type(e).__name__, e)

    def close(self, timeout_s: float = CLOSE_WAIT_S) -> None:
        """Let MLflow take what is queued (at most ``timeout_s``), then stop the thread."""
        if self.run_id is None:
            return
        try:
            self._queue.put(None, timeout=timeout_s)
        except queue.Full:
            pass
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            log.warning("phalanx: MLflow did not take the job's last figures within %g s", timeout_s)
        if self._dropped:
            log.warning("phalanx: %d of rank 0's records were not logged to MLflow (it was too slow)", self._dropped)
