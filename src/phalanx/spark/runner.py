"""``HorovodRunner``: Databricks' API (``sparkdl.HorovodRunner``) on a Spark barrier stage."""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable
from typing import TypeVar, cast

from phalanx.errors import InvalidArgumentError
from phalanx.job.report import entry_point
from phalanx.job.shipping import shipped_payload
from phalanx.launch.api import resolve_start_timeout
from phalanx.launch.core import JobSpec, start_timeout_hint
from phalanx.launch.warm import preload_for
from phalanx.spark.elastic_run import elastic_options, launch, local_elastic_kwargs
from phalanx.spark.gpus import gpus_per_task, ranks_per_task, uses_gpus
from phalanx.spark.session import every_slot, spark_target

#: What the training function returns on rank 0.
R = TypeVar("R")

log = logging.getLogger(__name__)

VERBOSITIES = ("log_callback_only", "all")


class HorovodRunner:
    """Run a Horovod training function as a Spark job (or on the driver, for debugging).

    Args:
        np: ``> 0``: that many ranks (processes; on a GPU cluster, GPUs): one per barrier task, or ``k`` per task
            when each task holds ``k`` GPUs (``spark.task.resource.gpu.amount=k``; ``np`` a multiple of ``k``),
            each pinned to one of its task's GPUs (``hvd.local_rank()`` is its device index).
            ``< 0``: ``-np`` processes on the driver, no Spark job (the debugging mode). ``0``: one rank per task
            slot (deprecated).
        driver_log_verbosity: ``"log_callback_only"`` (default) shows only :func:`log_to_driver`
            messages on the driver and keeps every rank's full output in files, which errors name;
            ``"all"`` streams every rank's output, prefixed ``[rank]<stream>:``.

        min_np: elastic training (phalanx's opt-in; see docs/elastic.md): the fewest ranks the job may go on
            with. Giving any of ``min_np``, ``max_np``, ``reset_limit`` or ``checkpoint_dir`` makes the job
            elastic: ``main`` uses ``hvd.elastic.run``, a lost worker is replaced and the others keep their
            work, as with :func:`phalanx.spark.run_elastic`.
        max_np: elastic: the most ranks (default ``np``).
        reset_limit: elastic: most re-formations plus stage re-submissions (default 3).
        checkpoint_dir: elastic: where commits are also written (shared storage), so that a stage Spark
            failed (a lost executor) is submitted again and resumes from the last commit.

    Raises:
        InvalidArgumentError: ``np`` is not an int, an unknown verbosity, or bad elastic settings.
    """

    def __init__(self, *, np: int, driver_log_verbosity: str = "log_callback_only", min_np: int | None = None,
                 max_np: int | None = None, reset_limit: int | None = None,
                 checkpoint_dir: str | None = None) -> None:
        if isinstance(np, bool) or not isinstance(np, int):
            raise InvalidArgumentError(f"np must be an int (ranks; negative: on the driver); got {np!r}")
        if driver_log_verbosity not in VERBOSITIES:
            raise InvalidArgumentError(
                f"driver_log_verbosity must be one of {VERBOSITIES}; got {driver_log_verbosity!r}"
            )
        self.num_processor = np
        self.driver_log_verbosity = driver_log_verbosity
        self.elastic = elastic_options(min_np, max_np, reset_limit, checkpoint_dir)
        if self.elastic is not None and np != 0:
            self.elastic.check_np(abs(np))

    @entry_point("HorovodRunner.run")
    def run(self, main: Callable[..., R], **kwargs: object) -> R:
        """Run ``main(**kwargs)`` on every rank and return rank 0's return value.

        Args:
            main: the training function (cloudpickled with the modules next to the driver's script).
            kwargs: keyword arguments for ``main``.

        Returns:
            What ``main`` returned on rank 0.

        Raises:
            PayloadError: ``main`` or an argument cannot be pickled.
            SlotsUnavailableError: the cluster cannot run ``np`` tasks at once.
            WorkerFailedError: a rank failed; root cause, traceback and log tail first.
            StartTimeoutError: ranks did not start within ``HOROVOD_SPARK_START_TIMEOUT`` (default 600 s).
        """
        np = self.num_processor
        if np < 0:
            from phalanx.launch.api import run as run_local

            log.info("HorovodRunner(np=%d): %d processes on the driver, no Spark job", np, -np)
            return run_local(main, kwargs=kwargs, np=-np, **local_elastic_kwargs(self.elastic))[0]
        payload = shipped_payload(main, (), kwargs)
        sc = spark_target()
        gpus = uses_gpus(sc)
        if np == 0:
            np = every_slot(sc, resolve_start_timeout(None, spark=True), start_timeout_hint(None, spark=True))
            np *= gpus_per_task(sc, gpus)
            warnings.warn(f"HorovodRunner(np=0) is deprecated: using every task slot ({np}); pass np=N",
                          DeprecationWarning, stacklevel=2)
        spec = JobSpec(
            np=np, payload=payload, use_gpu=gpus, ranks_per_task=ranks_per_task(sc, np, gpus, "np"),
            start_timeout_s=resolve_start_timeout(None, spark=True),
            start_timeout_hint=start_timeout_hint(None, spark=True), console=self._console(),
            description=f"HorovodRunner(np={np}).run({getattr(main, '__name__', 'main')})",
            warm_preload=preload_for(main),
        )
        return cast(R, launch(spec, sc, self.elastic).values[0])  # rank 0's unpickled return of main

    def _console(self) -> str:
        return "all" if self.driver_log_verbosity == "all" else "log_callback_only"
