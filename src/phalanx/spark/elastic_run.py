"""Elastic Spark jobs: ``run_elastic``, and the opt-in of ``HorovodRunner`` and ``TorchDistributor``.

Two levels. Within a barrier stage, a worker that dies while its executor lives is replaced in its own
slot and the survivors keep their work (:class:`~phalanx.spark.launcher.SparkLauncher` with an elastic policy).
When Spark fails the whole stage (a lost executor), the job is submitted again with
``PHALANX_ELASTIC_CHECKPOINT_DIR`` set, and ``hvd.elastic.run`` on the new rank 0 resumes from the last
durable commit. Both count against one ``reset_limit``.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import IO, TYPE_CHECKING, TypedDict, cast

from phalanx.env import names as env_names
from phalanx.errors import InvalidArgumentError, SparkJobError, WorkerFailedError
from phalanx.launch.api import elastic_spec, validate_np
from phalanx.launch.core import JobSpec
from phalanx.spark.api import AnyLauncher, R, launch_spark, run_spec
from phalanx.spark.connect.client import ConnectLauncher
from phalanx.spark.connect.session import is_connect
from phalanx.spark.launcher import SparkLauncher

if TYPE_CHECKING:
    from phalanx.spark.pyspark_types import SparkTarget

log = logging.getLogger(__name__)

#: ``reset_limit`` of an elastic Spark job when none is given.
DEFAULT_RESET_LIMIT = 3


class LocalElasticKwargs(TypedDict, total=False):
    """:func:`phalanx.run`'s elastic arguments, as :func:`local_elastic_kwargs` gives them."""

    min_np: int | None
    max_np: int | None
    reset_limit: int
    env: dict[str, str]


@dataclass(frozen=True)
class ElasticOptions:
    """The elastic settings of a Spark job, validated.

    Attributes:
        min_np: fewest workers the job may go on with (default 1).
        max_np: most workers (default: the job's ``np``).
        reset_limit: most re-formations plus stage re-submissions before the job fails.
        checkpoint_dir: where ``commit()`` also writes the state, so that a re-submitted stage resumes;
            None: a failed stage (a lost executor) is not re-submitted.
    """

    min_np: int | None = None
    max_np: int | None = None
    reset_limit: int = DEFAULT_RESET_LIMIT
    checkpoint_dir: str | None = None

    def check_np(self, np: int) -> None:
        """Check the counts against the job's ``np`` (before any Spark job starts).

        Raises:
            InvalidArgumentError: ``min_np <= np <= max_np`` does not hold.
        """
        elastic_spec(np, self.min_np, self.max_np, self.reset_limit)

    def env(self, env: Mapping[str, str]) -> dict[str, str]:
        """``env`` with ``PHALANX_ELASTIC_CHECKPOINT_DIR`` when there is a checkpoint directory."""
        if self.checkpoint_dir is None:
            return dict(env)
        return {**env, env_names.PHALANX_ELASTIC_CHECKPOINT_DIR: os.path.abspath(self.checkpoint_dir)}


def elastic_options(min_np: object = None, max_np: object = None, reset_limit: object = None,
                    checkpoint_dir: object = None) -> ElasticOptions | None:
    """The elastic settings given to a Spark entry point, or None when none was (a plain job).

    Raises:
        InvalidArgumentError: a count that is not a positive int, a bad ``reset_limit`` or directory.
    """
    if min_np is None and max_np is None and reset_limit is None and checkpoint_dir is None:
        return None
    lo = validate_np(min_np, "min_np") if min_np is not None else None
    hi = validate_np(max_np, "max_np") if max_np is not None else None
    if lo is not None and hi is not None and lo > hi:
        raise InvalidArgumentError(f"elastic job needs min_np <= max_np; got min_np={lo}, max_np={hi}")
    limit = DEFAULT_RESET_LIMIT if reset_limit is None else reset_limit
    if isinstance(limit, bool) or not isinstance(limit, int) or limit < 0:
        raise InvalidArgumentError(f"reset_limit must be an int >= 0; got {reset_limit!r}")
    if checkpoint_dir is not None and (not isinstance(checkpoint_dir, str | os.PathLike) or not str(checkpoint_dir)):
        raise InvalidArgumentError(
            f"checkpoint_dir must be a directory path every executor can reach; got {checkpoint_dir!r}")
    ckpt = os.fspath(checkpoint_dir) if checkpoint_dir is not None else None
    return ElasticOptions(lo, hi, limit, ckpt)


def launch(spec: JobSpec, sc: SparkTarget, options: ElasticOptions | None) -> AnyLauncher:
    """Run ``spec``: elastically with ``options``, else as a plain job (:func:`~phalanx.spark.api.launch_spark`)."""
    return launch_elastic(spec, sc, options) if options is not None else launch_spark(spec, sc)


def local_elastic_kwargs(options: ElasticOptions | None) -> LocalElasticKwargs:
    """The arguments of :func:`phalanx.run` that make a driver-local job (``np < 0``, ``local_mode``) elastic."""
    if options is None:
        return {}
    return {"min_np": options.min_np, "max_np": options.max_np, "reset_limit": options.reset_limit,
            "env": options.env({})}


def launch_elastic(spec: JobSpec, sc: SparkTarget, options: ElasticOptions) -> AnyLauncher:
    """Run ``spec`` elastically; return the launcher of the attempt that completed.

    Raises:
        InvalidArgumentError: bad counts for ``spec.np``.
        WorkerFailedError: the policy gave up (its reason and the root cause), or the last attempt failed.
        SparkJobError: Spark failed the stage and no re-submission was allowed.
    """
    options.check_np(spec.np)
    connect = is_connect(sc)
    if options.checkpoint_dir is not None:
        if connect:  # the client may not share the executors' filesystem: rank 0 makes the directory
            _check_executor_path(options.checkpoint_dir)
        else:
            os.makedirs(options.checkpoint_dir, exist_ok=True)
    spec = replace(spec, env=options.env(spec.env))
    remaining = options.reset_limit
    while True:
        elastic = elastic_spec(spec.np, options.min_np, options.max_np, remaining, spec.env)
        assert elastic is not None
        launcher: SparkLauncher | ConnectLauncher = (
            ConnectLauncher(spec, sc, elastic) if is_connect(sc) else SparkLauncher(spec, sc, elastic))
        started = time.monotonic()
        try:
            return launch_spark(spec, sc, launcher)
        except (WorkerFailedError, SparkJobError) as e:
            remaining -= launcher.resets + 1
            if launcher.spark_error is None or options.checkpoint_dir is None or remaining < 0:
                raise
            log.warning("elastic Spark job: Spark failed the stage after %.1f s (%s); re-submitting from the "
                        "last commit in %s (%d reset(s) left)", time.monotonic() - started,
                        str(e).splitlines()[0], options.checkpoint_dir, remaining)


def _check_executor_path(path: str) -> None:
    """On Spark Connect ``checkpoint_dir`` is a path as the executors see it: the client's working directory
    means nothing there.

    Raises:
        InvalidArgumentError: ``path`` is relative.
    """
    if not os.path.isabs(path):
        raise InvalidArgumentError(
            f"checkpoint_dir={path!r} is relative: on a Spark Connect session give an absolute path that every "
            "executor can read and write (the client's working directory means nothing to them)")


def run_elastic(
    fn: Callable[..., R],
    args: tuple[object, ...] = (),
    kwargs: Mapping[str, object] | None = None,
    num_proc: int | None = None,
    *,
    checkpoint_dir: str | None = None,
    min_np: int | None = None,
    max_np: int | None = None,
    reset_limit: int = DEFAULT_RESET_LIMIT,
    start_timeout: float | None = None,
    env: Mapping[str, str] | None = None,
    stdout: IO[str] | None = None,
    stderr: IO[str] | None = None,
    verbose: int = 1,
    **compat: object,
) -> list[R]:
    """Run ``fn`` like :func:`phalanx.spark.run`, surviving lost workers (``horovod.spark.run_elastic``).

    ``fn`` uses ``hvd.elastic.run`` and ``state.commit()``. A worker that dies while its executor lives
    is replaced in its slot; the others roll back to their last commit and keep going. When Spark fails
    the stage (a lost executor), the stage is submitted again and resumes from the last commit written
    to ``checkpoint_dir``.

    Args:
        fn: the function (see :func:`phalanx.spark.run`).
        args: positional arguments.
        kwargs: keyword arguments.
        num_proc: number of ranks (default: every task slot).
        checkpoint_dir: a directory every executor can read and write (shared storage on a real
            cluster); None: a failed stage is not re-submitted.
        min_np: fewest workers the job may go on with (default 1; ``min_num_proc`` is an alias).
        max_np: most workers (default ``num_proc``; ``max_num_proc`` is an alias).
        reset_limit: most re-formations plus stage re-submissions (default 3).
        start_timeout: seconds for slots and ranks to start.
        env: extra environment variables for every rank (``PHALANX_ELASTIC_TIMEOUT_S`` too).
        stdout: where the ranks' stdout lines go on the driver.
        stderr: where their stderr lines go.
        verbose: 0 quiet, 1 normal, 2 debug.
        compat: ``min_num_proc``/``max_num_proc``, and ``horovod.spark.run``'s ignored arguments.

    Returns:
        Every rank's value in the final world, in rank order.

    Raises:
        InvalidArgumentError: a bad argument (before any Spark job starts).
        WorkerFailedError: the job gave up (reset_limit reached, below min_np); root cause first.
        SparkJobError: Spark failed the last allowed stage.
    """
    options = elastic_options(compat.pop("min_num_proc", min_np), compat.pop("max_num_proc", max_np), reset_limit,
                              checkpoint_dir)
    assert options is not None
    spec, sc = run_spec(fn, args, kwargs, num_proc, start_timeout, env, stdout, stderr, verbose, compat)
    return cast("list[R]", launch_elastic(spec, sc, options).values)  # the ranks' unpickled returns of fn
