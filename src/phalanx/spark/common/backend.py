"""``horovod.spark.common.backend.SparkBackend``: how an estimator's ``fit`` runs its ranks.

Horovod's estimators take ``backend=SparkBackend(num_proc=..., stdout=..., stderr=..., ...)`` or
``num_proc=...``, never both. Here the backend's ``num_proc`` is the number of ranks, and its ``stdout``,
``stderr``, ``start_timeout``, ``env`` and ``verbose`` go to the job as :func:`phalanx.spark.run` takes them.
Horovod's other arguments (``prefix_output_with_timestamp``, ``nics``, ``use_mpi``, ``use_gloo``...) are
accepted and change nothing: phalanx's ranks always prefix their lines with the rank and run on gloo/NCCL
(docs/migration.md).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import IO, TypedDict, TypeVar

from phalanx.errors import InvalidArgumentError

#: What the function returns on each rank.
R = TypeVar("R")


class RunOptions(TypedDict):
    """A backend's arguments of :func:`phalanx.spark.run` besides ``env``."""

    stdout: IO[str] | None
    stderr: IO[str] | None
    start_timeout: float | None
    verbose: int


class Backend:
    """Horovod's backend interface: ``run`` a function on the ranks, and how many ranks there are."""

    def run(self, fn: Callable[..., R], args: tuple[object, ...] = (), kwargs: Mapping[str, object] | None = None,
            env: Mapping[str, str] | None = None) -> list[R]:
        """Every rank's return value of ``fn(*args, **kwargs)``, in rank order."""
        raise NotImplementedError

    def num_processes(self) -> int | None:
        """The number of ranks (None: one per task slot of the cluster)."""
        raise NotImplementedError


class SparkBackend(Backend):
    """Runs the ranks as a ``phalanx.spark`` job (Horovod's ``SparkBackend``)."""

    def __init__(self, num_proc: int | None = None, env: Mapping[str, str] | None = None,
                 stdout: IO[str] | None = None, stderr: IO[str] | None = None,
                 start_timeout: float | None = None, verbose: int = 1, **ignored: object) -> None:
        if num_proc is not None and (isinstance(num_proc, bool) or not isinstance(num_proc, int) or num_proc < 1):
            raise InvalidArgumentError(f"SparkBackend(num_proc={num_proc!r}): give an integer >= 1, or None for "
                                       "one rank per task slot of the cluster")
        self._num_proc = num_proc
        self._env = dict(env) if env is not None else None
        self._options = RunOptions(stdout=stdout, stderr=stderr, start_timeout=start_timeout, verbose=verbose)
        self.ignored = tuple(sorted(ignored))  # accepted for Horovod's signature; they change nothing here

    def num_processes(self) -> int | None:
        """``num_proc`` as given (None: one rank per task slot, counted when the job starts)."""
        return self._num_proc

    def job_env(self, env: Mapping[str, str] | None = None) -> dict[str, str]:
        """The variables the ranks get: the backend's ``env`` (Horovod: else none beyond the executors'),
        updated with ``env``."""
        full = dict(self._env or {})
        full.update(env or {})
        return full

    def options(self) -> RunOptions:
        """``stdout``, ``stderr``, ``start_timeout`` and ``verbose`` as :func:`phalanx.spark.run` takes them."""
        return self._options.copy()

    def run(self, fn: Callable[..., R], args: tuple[object, ...] = (), kwargs: Mapping[str, object] | None = None,
            env: Mapping[str, str] | None = None) -> list[R]:
        """``phalanx.spark.run(fn, ...)`` with this backend's settings."""
        from phalanx.spark.api import run

        job_env = {k: v for k, v in self.job_env(env).items() if k != "CUDA_VISIBLE_DEVICES"}
        return run(fn, tuple(args), kwargs, num_proc=self._num_proc, env=job_env, **self._options)


def num_proc_of(num_proc: int | None, backend: Backend | None) -> int | None:
    """The estimator's number of ranks from its ``num_proc`` and ``backend`` parameters (Horovod's rule: at
    most one of them).

    Raises:
        InvalidArgumentError: both are given, or ``backend`` is not a :class:`Backend`.
    """
    if backend is None:
        return num_proc
    if not isinstance(backend, Backend):
        raise InvalidArgumentError(f"backend={backend!r}: give a SparkBackend (from "
                                   "horovod.spark.common.backend import SparkBackend) or leave it None")
    if num_proc is not None:
        raise InvalidArgumentError('At most one of parameters "backend" and "num_proc" may be specified: '
                                   f"num_proc={num_proc} and backend={type(backend).__name__}(...); pass "
                                   "SparkBackend(num_proc=...) alone")
    return backend.num_processes()
