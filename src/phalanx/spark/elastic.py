"""``phalanx.spark.run_elastic``: a Spark job that survives lost workers by resuming from durable commits.

A barrier stage cannot replace one of its tasks: when a rank dies (SIGKILL, a lost executor) Spark fails
the whole stage. ``run_elastic`` then submits the job again, up to ``reset_limit`` times, with
``PHALANX_ELASTIC_CHECKPOINT_DIR`` set: ``hvd.elastic.run`` on the new rank 0 loads the last durable
commit and broadcasts it, so the work lost is what was done since that commit (plus the stage's restart).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Mapping
from typing import Any

from phalanx.env import names as N
from phalanx.errors import InvalidArgumentError, SparkJobError, WorkerFailedError

log = logging.getLogger(__name__)


def _attempt_env(env: Mapping[str, str] | None, checkpoint_dir: str) -> dict[str, str]:
    return {**(env or {}), N.PHALANX_ELASTIC_CHECKPOINT_DIR: os.path.abspath(checkpoint_dir)}


def run_elastic(
    fn: Callable[..., Any],
    args: tuple[Any, ...] = (),
    kwargs: dict[str, Any] | None = None,
    num_proc: int | None = None,
    *,
    checkpoint_dir: str,
    reset_limit: int = 3,
    env: Mapping[str, str] | None = None,
    **run_kwargs: Any,
) -> list[Any]:
    """Run ``fn`` like :func:`phalanx.spark.run`, re-submitting the stage after a lost worker.

    ``fn`` should use ``hvd.elastic.run`` and ``state.commit()``; commits are written to
    ``checkpoint_dir`` (temporary file, then rename), and every attempt resumes from the last one.

    Args:
        fn: the function (see :func:`phalanx.spark.run`).
        args: positional arguments.
        kwargs: keyword arguments.
        num_proc: number of ranks.
        checkpoint_dir: a directory every executor can read and write (shared storage on a real cluster).
        reset_limit: how many times the stage may be re-submitted after a failure.
        env: extra environment variables for every rank.
        run_kwargs: the other arguments of :func:`phalanx.spark.run`.

    Returns:
        Every rank's value from the attempt that completed, in rank order.

    Raises:
        InvalidArgumentError: a bad ``reset_limit`` or ``checkpoint_dir``.
        WorkerFailedError: the last allowed attempt failed too (its root-cause report).
        SparkJobError: likewise, when Spark itself failed the stage.
    """
    from phalanx.spark.api import run

    if isinstance(reset_limit, bool) or not isinstance(reset_limit, int) or reset_limit < 0:
        raise InvalidArgumentError(f"reset_limit must be an int >= 0; got {reset_limit!r}")
    if not checkpoint_dir:
        raise InvalidArgumentError("run_elastic needs checkpoint_dir= (a directory every executor can reach)")
    os.makedirs(checkpoint_dir, exist_ok=True)
    attempt_env = _attempt_env(env, checkpoint_dir)
    for attempt in range(reset_limit + 1):
        started = time.monotonic()
        try:
            return run(fn, args, kwargs, num_proc, env=attempt_env, **run_kwargs)
        except (WorkerFailedError, SparkJobError) as e:
            if attempt == reset_limit:
                raise
            log.warning("elastic Spark job: attempt %d failed after %.1f s (%s); re-submitting from the "
                        "last commit in %s", attempt + 1, time.monotonic() - started,
                        str(e).splitlines()[0], checkpoint_dir)
    raise AssertionError("unreachable")  # the loop returns or raises
