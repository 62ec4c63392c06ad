"""``phalanx.spark.run``: the contract of ``horovod.spark.run`` on a Spark barrier stage."""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import IO, TYPE_CHECKING, TypeVar, cast

from phalanx.env.contract import nic_env
from phalanx.errors import InvalidArgumentError, PhalanxError, WorkerFailedError
from phalanx.job.report import entry_point
from phalanx.job.shipping import shipped_payload
from phalanx.launch.api import resolve_start_timeout, validate_env, validate_np
from phalanx.launch.core import JobSpec, start_timeout_hint
from phalanx.launch.warm import preload_for
from phalanx.observe import resolve as resolve_observe
from phalanx.spark.connect.client import ConnectLauncher
from phalanx.spark.connect.session import is_connect
from phalanx.spark.gpus import gpus_per_task, ranks_per_task, uses_gpus
from phalanx.spark.launcher import SparkLauncher
from phalanx.spark.session import every_slot, spark_target, wait_for_slots

if TYPE_CHECKING:
    from phalanx.spark.pyspark_types import SparkTarget

#: What the user's function returns on each rank.
R = TypeVar("R")

log = logging.getLogger("phalanx")

#: horovod.spark.run arguments accepted for compatibility and ignored (phalanx uses gloo, no MPI).
IGNORED_RUN_ARGS = frozenset({
    "extra_mpi_args", "use_mpi", "use_gloo", "prefix_output_with_timestamp", "executable",
})
#: horovod.spark.run arguments that take effect: ``nics`` (the ranks' NCCL_SOCKET_IFNAME / GLOO_SOCKET_IFNAME).
EFFECTIVE_RUN_ARGS = frozenset({"nics"})
_START_HINT = start_timeout_hint("start_timeout=", spark=True)
#: A classic launcher, or the one of a Spark Connect session (same attributes: values, log_dir, ...).
AnyLauncher = SparkLauncher | ConnectLauncher


def launch_spark(spec: JobSpec, sc: SparkTarget, launcher: AnyLauncher | None = None) -> AnyLauncher:
    """Check the slots, then run the job; return the finished launcher (values in ``.values``).

    Args:
        spec: the job.
        sc: the SparkContext, or a Spark Connect session (:mod:`phalanx.spark.connect.client`).
        launcher: the launcher to run (an elastic one); default a plain :class:`SparkLauncher` (or
            :class:`~phalanx.spark.connect.ConnectLauncher` on a Connect session).

    Raises:
        SlotsUnavailableError, WorkerFailedError, StartTimeoutError, SparkJobError.
    """
    if is_connect(sc):
        if spec.observe is not None:  # the job's monitor runs in an executor's task there, not on this client
            log.warning("phalanx: the job page and MLflow logging are not available on a Spark Connect "
                        "session (the job is watched from an executor); running without them")
            spec = replace(spec, observe=None)
        launcher = launcher or ConnectLauncher(spec, sc)
    else:
        wait_for_slots(sc, spec.np, spec.start_timeout_s, spec.start_timeout_hint, spec.ranks_per_task)
        launcher = launcher or SparkLauncher(spec, sc)
    try:
        launcher.run()
    except WorkerFailedError as e:
        root = e.root_cause.exc_type or ""
        if launcher.spark_error is not None and root.endswith("SparkJobError"):
            raise launcher.spark_error from e
        _note_logs(launcher, e)
        raise
    except PhalanxError as e:
        _note_logs(launcher, e)
        raise
    return launcher


def _note_logs(launcher: AnyLauncher, e: BaseException) -> None:
    if launcher.log_dir is not None:
        note = f"Full output of every rank: {launcher.log_dir}/rank.N/{{stdout,stderr}}"
        log.error("phalanx: %s", note)
        if hasattr(e, "add_note"):
            e.add_note(note)


def _check_compat_args(extra: Mapping[str, object]) -> None:
    unknown = sorted(set(extra) - IGNORED_RUN_ARGS - EFFECTIVE_RUN_ARGS)
    if unknown:
        raise InvalidArgumentError(
            f"run() got unexpected argument(s) {unknown}; phalanx.spark.run accepts horovod.spark.run's "
            f"arguments (ignored for compatibility: {sorted(IGNORED_RUN_ARGS)})"
        )
    ignored = sorted(set(extra) - EFFECTIVE_RUN_ARGS)
    if ignored:
        log.debug("phalanx.spark.run ignores %s (phalanx uses gloo, no MPI)", ignored)


def _nics(value: object) -> tuple[str, ...]:
    """``nics=`` as NIC names (a list, a set, or a comma-separated string).

    Raises:
        InvalidArgumentError: not names.
    """
    if value is None:
        return ()
    names = value.split(",") if isinstance(value, str) else value
    if not isinstance(names, list | tuple | set | frozenset) or not all(isinstance(n, str) for n in names):
        raise InvalidArgumentError(f"nics must be network interface names (e.g. ['eth0']); got {value!r}")
    return tuple(sorted(names) if isinstance(names, set | frozenset) else names)


@entry_point("phalanx.spark.run")
def run(
    fn: Callable[..., R],
    args: tuple[object, ...] = (),
    kwargs: Mapping[str, object] | None = None,
    num_proc: int | None = None,
    start_timeout: float | None = None,
    env: Mapping[str, str] | None = None,
    stdout: IO[str] | None = None,
    stderr: IO[str] | None = None,
    verbose: int = 1,
    dashboard: bool | int | str | None = None,
    mlflow: bool | None = None,
    **compat: object,
) -> list[R]:
    """Run ``fn(*args, **kwargs)`` as ``num_proc`` ranks of a Spark barrier stage (``horovod.spark.run``).

    Args:
        fn: the function; it travels by cloudpickle, with the modules next to the driver's script.
        args: positional arguments.
        kwargs: keyword arguments.
        num_proc: number of ranks (default: every task slot of the cluster).
        start_timeout: seconds for Spark to schedule the tasks and the ranks to start (default
            ``HOROVOD_SPARK_START_TIMEOUT``, else ``HOROVOD_START_TIMEOUT``, else 600, as ``horovod.spark.run``).
        env: extra environment variables for every rank (``HOROVOD_TIMELINE`` too).
        stdout: where the ranks' stdout lines go on the driver (default ``sys.stdout``).
        stderr: where the ranks' stderr lines go (default ``sys.stderr``).
        verbose: 0 quiet, 1 normal, 2 debug logging of the launcher.
        dashboard: serve the job's live page and ``/metrics`` from the driver (as ``phalanx.run``'s; default:
            ``PHALANX_DASHBOARD``, else off; not on a Spark Connect session).
        mlflow: log the job's metrics and timeline summary to the driver's active MLflow run (default:
            ``PHALANX_MLFLOW``, else off).
        compat: ``nics`` (NIC names: the ranks' ``NCCL_SOCKET_IFNAME`` and ``GLOO_SOCKET_IFNAME``, unless ``env``
            sets them), and horovod.spark.run's arguments without meaning here (``use_mpi``...), ignored.

    Returns:
        Every rank's return value, in rank order.

    Raises:
        InvalidArgumentError: a bad argument (before Spark is touched, when possible).
        PayloadError: ``fn`` or an argument cannot be pickled.
        SlotsUnavailableError: the cluster cannot run ``num_proc`` tasks at once.
        WorkerFailedError: a rank failed; the root cause, its traceback and log tail come first.
        StartTimeoutError: ranks did not start in time.
    """
    spec, sc = run_spec(fn, args, kwargs, num_proc, start_timeout, env, stdout, stderr, verbose, compat)
    spec = replace(spec, observe=resolve_observe(dashboard, mlflow))
    return cast("list[R]", launch_spark(spec, sc).values)  # the ranks' unpickled returns of fn


def run_spec(fn: Callable[..., object], args: tuple[object, ...], kwargs: Mapping[str, object] | None,
             num_proc: int | None, start_timeout: float | None, env: Mapping[str, str] | None,
             stdout: IO[str] | None, stderr: IO[str] | None, verbose: int, compat: Mapping[str, object],
             ) -> tuple[JobSpec, SparkTarget]:
    """Validate :func:`run`'s arguments and build its job; return it with the SparkContext (or the Spark
    Connect session) to run it on.

    Raises:
        InvalidArgumentError, PayloadError: see :func:`run`.
    """
    _check_compat_args(compat)
    timeout = resolve_start_timeout(start_timeout, spark=True)
    user_env = validate_env(env)
    user_env = {**nic_env(_nics(compat.get("nics")), user_env), **user_env}
    payload = shipped_payload(fn, tuple(args), dict(kwargs or {}))
    if verbose >= 2:
        logging.getLogger("phalanx").setLevel(logging.DEBUG)
    sc = spark_target(progress=verbose > 0)
    gpus = uses_gpus(sc)
    if num_proc is None:
        np = every_slot(sc, timeout, _START_HINT) * gpus_per_task(sc, gpus)
    else:
        np = validate_np(num_proc, "num_proc")
    spec = JobSpec(np=np, payload=payload, env=user_env, start_timeout_s=timeout, use_gpu=gpus,
                   ranks_per_task=ranks_per_task(sc, np, gpus, "num_proc"),
                   start_timeout_hint=_START_HINT, stdout=stdout, stderr=stderr,
                   description=f"phalanx.spark.run({getattr(fn, '__name__', 'fn')})", progress=verbose > 0,
                   warm_preload=preload_for(fn))
    return spec, sc
