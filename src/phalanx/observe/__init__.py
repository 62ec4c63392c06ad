"""See a job while it runs: its live page, Prometheus metrics and MLflow logging (docs/observe.md).

Launchers call :func:`open_watch` with the job's :class:`ObserveOptions` before the ranks start, give the
monitor ``watch.observe`` as its observer (:mod:`phalanx.job.observation`), and call ``watch.close()`` when
the job is judged (the page stays up; MLflow gets the last figures). Nothing here runs when the user asked
for nothing: the options are None and no rank sends stats.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field

from phalanx.job.observation import Observation, Observer
from phalanx.observe.board import JobBoard
from phalanx.observe.mlflow_log import MlflowLog
from phalanx.observe.options import ObserveOptions, parse_dashboard, resolve
from phalanx.observe.server import Dashboard, announce, dashboard_for

__all__ = ["JobBoard", "JobWatch", "ObserveOptions", "open_watch", "parse_dashboard", "resolve"]


@dataclass
class JobWatch:
    """One observed job: its board, the page that shows it (if asked for) and its MLflow log (if asked for)."""

    board: JobBoard
    dashboard: Dashboard | None = None
    mlflow: MlflowLog | None = None
    _observers: list[Observer] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._observers = [self.board.observe]
        if self.mlflow is not None:
            self._observers.append(self.mlflow.observe)

    def observe(self, obs: Observation) -> None:
        """The monitor's observer: the board first (MLflow reads the rates it computes)."""
        for observer in self._observers:
            observer(obs)

    def close(self) -> None:
        """The job is judged: MLflow takes its last figures; the page stays up until the driver exits."""
        if self.mlflow is not None:
            self.mlflow.close()


def open_watch(options: ObserveOptions | None, run_id: str, world_size: int, kind: str = "job") -> JobWatch | None:
    """Start observing a job (before its ranks start), or None when ``options`` ask for nothing.

    Raises:
        InvalidArgumentError: the page cannot listen where asked.
    """
    if options is None:
        return None
    board = JobBoard(run_id, world_size, kind)
    server = None
    if options.dashboard is not None:
        server, _ = dashboard_for(*options.dashboard)
        server.show(board)
        announce(server)
    log = MlflowLog(importlib.import_module("mlflow"), board) if options.mlflow else None
    return JobWatch(board, server, log)
