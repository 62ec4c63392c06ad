"""``TorchDistributor``: pyspark's API (``pyspark.ml.torch.distributor``) on phalanx's launchers.

Two of pyspark's behaviours are fixed: a function returns rank 0's value (pyspark returns whichever
rank wrote its output last), and a script returns rank 0's stdout and raises when a rank fails
(pyspark's wrapper exits 0 whatever torchrun returned).
"""

from __future__ import annotations

import os
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar, cast, overload

from phalanx.env import names as env_names
from phalanx.errors import InvalidArgumentError
from phalanx.job.report import entry_point
from phalanx.job.shipping import shipped_payload
from phalanx.launch.api import resolve_start_timeout, validate_np
from phalanx.launch.core import JobSpec, start_timeout_hint
from phalanx.launch.warm import preload_for
from phalanx.spark.api import AnyLauncher
from phalanx.spark.elastic_run import elastic_options, launch, local_elastic_kwargs
from phalanx.spark.gpus import check_gpu_conf, ranks_per_task
from phalanx.spark.session import spark_target
from phalanx.spark.task import task_gpus

#: What the training function returns on rank 0.
R = TypeVar("R")

_START_HINT = start_timeout_hint(None, spark=True)


def driver_gpus(environ: dict[str, str] | None = None) -> list[str]:
    """The driver's GPUs as device ids of the machine: Spark's driver resources when a context runs, else
    CUDA's devices; both read through the driver's own ``CUDA_VISIBLE_DEVICES`` when a cluster manager set it
    (an address or a CUDA index is then a position in that list), so the ranks get the devices the driver
    was given, never the machine's first ones."""
    env = dict(os.environ) if environ is None else environ
    if "pyspark" in sys.modules:
        from pyspark import SparkContext

        sc = SparkContext._active_spark_context
        gpu = sc.resources.get("gpu") if sc is not None else None
        if gpu is not None and gpu.addresses:
            return task_gpus({"gpu": gpu}, env)
    restricted = env.get(env_names.CUDA_VISIBLE_DEVICES)
    if restricted is not None:
        return [d.strip() for d in restricted.split(",") if d.strip()]
    import torch

    return [str(i) for i in range(torch.cuda.device_count())]


def script_command(path: str, args: tuple[object, ...]) -> tuple[str, ...]:
    """``(absolute script path, *args as str)``.

    Raises:
        InvalidArgumentError: the script does not exist on the driver.
    """
    script = Path(path)
    if not script.is_file():
        raise InvalidArgumentError(f"train_object {path!r} is not a file; pass a function or a script path")
    return (str(script.resolve()), *(str(a) for a in args))


class TorchDistributor:
    """Run a PyTorch training function or script on ``num_processes`` ranks.

    Args:
        num_processes: number of ranks (> 0).
        local_mode: True: every rank on the driver (no Spark job); False: one barrier task per rank, or, with
            ``use_gpu`` and ``k`` GPUs per task (``spark.task.resource.gpu.amount=k``), ``num_processes / k``
            tasks of ``k`` ranks each (pyspark's rule; ``num_processes`` must be a multiple of ``k``).
        use_gpu: pin each rank to one GPU: its task's ``TaskContext.resources()["gpu"]`` (or, in local mode,
            the driver's GPUs) as ``CUDA_VISIBLE_DEVICES`` in local-rank order, so ``cuda:LOCAL_RANK`` is the
            rank's own GPU; an error when there are none.

        min_np: elastic training (phalanx's opt-in; see docs/elastic.md): the fewest ranks the job may go on
            with. Giving any of ``min_np``, ``max_np``, ``reset_limit`` or ``checkpoint_dir`` makes a
            function job elastic: it uses ``hvd.elastic.run``, a lost worker is replaced and the others keep
            their work, as with :func:`phalanx.spark.run_elastic`. Scripts are not run elastically.
        max_np: elastic: the most ranks (default ``num_processes``).
        reset_limit: elastic: most re-formations plus stage re-submissions (default 3).
        checkpoint_dir: elastic: where commits are also written (shared storage), so that a stage Spark
            failed (a lost executor) is submitted again and resumes from the last commit.

    Raises:
        InvalidArgumentError: ``num_processes`` is not a positive int, or bad elastic settings.
    """

    def __init__(self, num_processes: int = 1, local_mode: bool = True, use_gpu: bool = True, *,
                 min_np: int | None = None, max_np: int | None = None, reset_limit: int | None = None,
                 checkpoint_dir: str | None = None) -> None:
        self.num_processes = validate_np(num_processes, "num_processes")
        self.local_mode = bool(local_mode)
        self.use_gpu = bool(use_gpu)
        self.elastic = elastic_options(min_np, max_np, reset_limit, checkpoint_dir)
        if self.elastic is not None:
            self.elastic.check_np(self.num_processes)

    @overload
    def run(self, train_object: Callable[..., R], *args: object, **kwargs: object) -> R: ...

    @overload
    def run(self, train_object: str | os.PathLike[str], *args: object, **kwargs: object) -> str: ...

    @entry_point("TorchDistributor.run")
    def run(self, train_object: Callable[..., R] | str | os.PathLike[str], *args: object, **kwargs: object,
            ) -> R | str:
        """Run ``train_object`` on every rank.

        Args:
            train_object: a function (called with ``*args, **kwargs``) or the path of a Python script
                (run as ``python script *args`` on every rank; it must exist on the executors too).
            args: arguments of the function, or command-line arguments of the script.
            kwargs: keyword arguments of the function.

        Returns:
            A function's return value on rank 0, or rank 0's stdout for a script.

        Raises:
            InvalidArgumentError: a bad argument, ``use_gpu=True`` without GPUs.
            WorkerFailedError: a rank failed (``.exit_code`` is the root cause's exit code).
            SlotsUnavailableError: the cluster cannot run ``num_processes`` tasks at once.
        """
        if isinstance(train_object, str | os.PathLike):
            if self.elastic is not None:
                raise InvalidArgumentError(
                    "elastic training (min_np/max_np/reset_limit/checkpoint_dir) runs a function that uses "
                    f"hvd.elastic.run, not a script ({os.fspath(train_object)!r}); pass the training function")
            command = script_command(os.fspath(train_object), args)
            if kwargs:
                raise InvalidArgumentError(f"a script takes no keyword arguments; got {sorted(kwargs)}")
            return self._run_script(command)
        if not callable(train_object):
            raise InvalidArgumentError(f"train_object must be a function or a script path; got {train_object!r}")
        if self.local_mode:
            return self._local(train_object, args, kwargs)
        payload = shipped_payload(train_object, args, kwargs)
        return cast(R, self._spark(payload=payload, command=None, preload=preload_for(train_object)).values[0])

    def _run_script(self, command: tuple[str, ...]) -> str:
        if self.local_mode:
            return self._local_script(command)
        lines = self._spark(payload=b"", command=command).rank0_stdout.lines
        return "".join(line + "\n" for line in lines)

    def _spark(self, payload: bytes, command: tuple[str, ...] | None,
               preload: tuple[str, ...] | None = None) -> AnyLauncher:
        sc = spark_target()
        check_gpu_conf(sc, self.use_gpu)
        name = Path(command[0]).name if command else "function"
        spec = JobSpec(
            np=self.num_processes, payload=payload, command=command, use_gpu=self.use_gpu,
            ranks_per_task=ranks_per_task(sc, self.num_processes, self.use_gpu, "num_processes"),
            start_timeout_s=resolve_start_timeout(None, spark=True), start_timeout_hint=_START_HINT,
            description=f"TorchDistributor(num_processes={self.num_processes}).run({name})",
            warm_preload=preload,
        )
        return launch(spec, sc, self.elastic)

    def _gpu_env(self) -> dict[str, str]:
        if not self.use_gpu:
            return {}
        gpus = driver_gpus()
        if len(gpus) < self.num_processes:
            raise InvalidArgumentError(
                f"use_gpu=True with local_mode=True needs {self.num_processes} GPUs on the driver; found "
                f"{len(gpus)} ({gpus or 'none'}); lower num_processes, or pass use_gpu=False to train on CPUs"
            )
        return {env_names.CUDA_VISIBLE_DEVICES: ",".join(gpus)}

    def _local(self, fn: Callable[..., R], args: tuple[object, ...], kwargs: dict[str, object]) -> R:
        from phalanx.launch.api import run as run_local

        elastic = local_elastic_kwargs(self.elastic)
        elastic["env"] = {**self._gpu_env(), **elastic.get("env", {})}
        return run_local(fn, args=args, kwargs=kwargs, np=self.num_processes, **elastic)[0]

    def _local_script(self, command: tuple[str, ...]) -> str:
        from phalanx.launch.local import LocalLauncher

        env = self._gpu_env()
        with tempfile.TemporaryDirectory(prefix="phalanx-distributor-") as logs:
            spec = JobSpec(np=self.num_processes, command=(sys.executable, *command), env=env,
                           start_timeout_s=resolve_start_timeout(None), output_dir=logs)
            LocalLauncher(spec).run()
            out = Path(logs, "rank.0", "stdout")
            return out.read_text(encoding="utf-8") if out.exists() else ""
