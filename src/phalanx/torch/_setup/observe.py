"""A command's rank reports its stats to the driver (``phalanxrun --dashboard python train.py``).

A function job's worker starts the reporter on its own channel (:mod:`phalanx.worker.runtime`); a command has
no channel, so ``hvd.init()`` opens one for the stats records when the launcher asked for them
(``PHALANX_STATS_INTERVAL_S``), authenticated with the job's secret like any rank's.
"""

from __future__ import annotations

import os
from collections.abc import Callable

from phalanx.env import names as env_names
from phalanx.env import settings
from phalanx.job import stats
from phalanx.job.channel import Role, WorkerChannel
from phalanx.job.framing import Kind


def report_stats() -> None:
    """Start sending this rank's stats when asked for and nobody sends them yet (never raises for it)."""
    if stats.reporting() or settings.STATS_INTERVAL.get() is None or not settings.CHANNEL.get():
        return
    worker = settings.ELASTIC_WORKER_ID.get()
    rank = settings.first_int(os.environ, env_names.RANK, env_names.HOROVOD_RANK, default=0)
    wid = rank if worker is None else worker
    address, secret, timeout_s = settings.CHANNEL.get(), settings.SECRET.get(), settings.START_TIMEOUT.get()

    def connect() -> Callable[[bytes], None]:
        channel = WorkerChannel.connect(address, secret, wid, Role.WORKER, timeout_s)
        return lambda body: channel.send(Kind.STATS, body)

    stats.ensure_reporter(wid, connect, settings.HOSTNAME.get() or None)
