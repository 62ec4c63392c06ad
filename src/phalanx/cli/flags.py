"""horovodrun's flags (Horovod 0.28.1) beyond the core ones ``phalanxrun`` parses in ``cli/main.py``.

Every flag ``horovodrun`` accepts parses here. A flag that maps to something phalanx has takes effect the
way ``horovodrun`` applies it: it sets the Horovod variable the ranks read (``HOROVOD_FUSION_THRESHOLD``,
``HOROVOD_STALL_CHECK_TIME_SECONDS``, ``HOROVOD_LOG_LEVEL``...; see :func:`knob_env`) or changes what the
launcher does. A flag that maps to nothing (MPI, autotuning, jsrun, NCCL streams...) is accepted, and
:func:`noop_warnings` names it once with the reason it changes nothing.

Values a ``--config-file`` may also set default to None here, so that the file fills exactly the flags
the command line left unset (``horovodrun``'s rule: the command line wins).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from phalanx.env import names as env_names
from phalanx.errors import InvalidArgumentError

#: ``--log-level`` values (Horovod's list); ``TRACE`` logs as DEBUG and ``FATAL`` as CRITICAL.
LOG_LEVELS = ("TRACE", "DEBUG", "INFO", "WARNING", "ERROR", "FATAL")

_MPI = "phalanx runs on gloo (CPU) and NCCL (CUDA), never MPI"
_AUTOTUNE = "phalanx has no autotuner: the fusion threshold is --fusion-threshold-mb, nothing is tuned at run time"
_HIER = ("phalanx picks the algorithm itself: shared memory within a host, hierarchical (host leaders over gloo) "
         "across hosts")


@dataclass(frozen=True)
class Flag:
    """One horovodrun flag: its spellings, its argparse ``dest`` and kind, and why it is a no-op (if so).

    ``kind``: ``int``, ``float``, ``str``, ``on`` / ``off`` (a switch storing True / False, default None),
    ``pair`` (two ints).
    """

    names: tuple[str, ...]
    dest: str
    kind: str
    noop: str | None = None
    doc: str = "as horovodrun"


FLAGS: tuple[Flag, ...] = (
    Flag(("--fusion-threshold-mb",), "fusion_threshold_mb", "int",
         doc="largest fused gradient bucket in MiB (HOROVOD_FUSION_THRESHOLD)"),
    Flag(("--cycle-time-ms",), "cycle_time_ms", "float",
         "phalanx has no background cycle: each collective starts when every rank has called it"),
    Flag(("--cache-capacity",), "cache_capacity", "int",
         "phalanx caches collective signatures itself (every rank still checks its full signature)"),
    Flag(("--hierarchical-allreduce",), "hierarchical_allreduce", "on", _HIER),
    Flag(("--no-hierarchical-allreduce",), "hierarchical_allreduce", "off", _HIER),
    Flag(("--hierarchical-allgather",), "hierarchical_allgather", "on", _HIER),
    Flag(("--no-hierarchical-allgather",), "hierarchical_allgather", "off", _HIER),
    Flag(("--torus-allreduce",), "torus_allreduce", "on", _HIER),
    Flag(("--no-torus-allreduce",), "torus_allreduce", "off", _HIER),
    Flag(("--autotune",), "autotune", "on", _AUTOTUNE),
    Flag(("--no-autotune",), "autotune", "off", _AUTOTUNE),
    Flag(("--autotune-log-file",), "autotune_log_file", "str", _AUTOTUNE),
    Flag(("--autotune-warmup-samples",), "autotune_warmup_samples", "int", _AUTOTUNE),
    Flag(("--autotune-steps-per-sample",), "autotune_steps_per_sample", "int", _AUTOTUNE),
    Flag(("--autotune-bayes-opt-max-samples",), "autotune_bayes_opt_max_samples", "int", _AUTOTUNE),
    Flag(("--autotune-gaussian-process-noise",), "autotune_gaussian_process_noise", "float", _AUTOTUNE),
    Flag(("--elastic-timeout",), "elastic_timeout", "int",
         doc="seconds a worker waits for a new round (PHALANX_ELASTIC_TIMEOUT_S)"),
    Flag(("--blacklist-cooldown-range",), "cooldown_range", "pair",
         "no blacklist cooldown: a host whose ssh failed, or that failed its check when discovery added it, "
         "stays out for the rest of the job"),
    Flag(("--no-timeline-mark-cycles",), "timeline_mark_cycles", "off", doc="no CYCLE_START marks (the default)"),
    Flag(("--no-stall-check",), "no_stall_check", "on", doc="turn the stall check off (HOROVOD_STALL_CHECK_DISABLE=1)"),
    Flag(("--stall-check",), "no_stall_check", "off", doc="keep the stall check on (the default)"),
    Flag(("--stall-check-warning-time-seconds",), "stall_check_warning_time_seconds", "int",
         doc="seconds before a stalled collective is logged (default 60)"),
    Flag(("--stall-check-shutdown-time-seconds",), "stall_check_shutdown_time_seconds", "int",
         doc="seconds of stall after which the waiting rank raises HorovodInternalError (default 0: never)"),
    Flag(("--mpi-threads-disable",), "mpi_threads_disable", "on", _MPI),
    Flag(("--no-mpi-threads-disable",), "mpi_threads_disable", "off", _MPI),
    Flag(("--mpi-args",), "mpi_args", "str", _MPI),
    Flag(("--tcp",), "tcp_flag", "on", doc="keep NCCL off InfiniBand (NCCL_IB_DISABLE=1)"),
    Flag(("--binding-args",), "binding_args", "str", "phalanx does not bind processes (that is mpirun's option)"),
    Flag(("--num-nccl-streams",), "num_nccl_streams", "int",
         "phalanx's CUDA collectives run on torch's NCCL process group, which manages its own streams"),
    Flag(("--thread-affinity",), "thread_affinity", "int",
         "phalanx has no pinned background thread (set OMP_NUM_THREADS or taskset for CPU placement)"),
    Flag(("--gloo-timeout-seconds",), "gloo_timeout_seconds", "int",
         doc="timeout of one gloo operation on the default group (default: torch's)"),
    Flag(("--log-level",), "log_level", "level", doc="level of the phalanx loggers in the ranks (HOROVOD_LOG_LEVEL)"),
    Flag(("--log-with-timestamp",), "log_with_timestamp", "on",
         doc="time in the ranks' phalanx log lines (the default)"),
    Flag(("--log-without-timestamp",), "log_with_timestamp", "off",
         doc="no time in the ranks' phalanx log lines (HOROVOD_LOG_HIDE_TIME=1)"),
    Flag(("--log-hide-timestamp",), "log_with_timestamp", "off", doc="deprecated spelling of --log-without-timestamp"),
    Flag(("--no-log-hide-timestamp",), "log_with_timestamp", "on", doc="deprecated spelling of --log-with-timestamp"),
    Flag(("-prefix-timestamp", "--prefix-output-with-timestamp"), "prefix_output_with_timestamp", "on",
         doc="start each output line with the local time"),
    Flag(("--mpi",), "use_mpi", "on", _MPI + "; the job runs on gloo"),
    Flag(("--jsrun",), "use_jsrun", "on", "phalanxrun starts its ranks itself (no jsrun, no MPI)"),
)

#: Host flags (multi-host launching; cli/main.py turns them into the hosts launcher's spec and warns when
#: every host is this machine, where ssh options change nothing).
HOST_FLAGS: tuple[Flag, ...] = (
    Flag(("-hostfile", "--hostfile"), "hostfile", "str", doc="a file of 'host slots=N' lines (instead of -H)"),
    Flag(("-p", "--ssh-port"), "ssh_port", "int", doc="the hosts' ssh port"),
    Flag(("-i", "--ssh-identity-file"), "ssh_identity_file", "str", doc="the ssh key for the hosts"),
    Flag(("--network-interfaces",), "nics", "str", doc="comma-separated interfaces the ranks use between hosts"),
    Flag(("--network-interface",), "nic", "str", doc="deprecated spelling of --network-interfaces"),
    Flag(("--slots-per-host",), "slots", "int",
         doc="slots of a host listed without its own (a discovery script's 'host' line, -H host, a hostfile "
             "line without slots=); host:slots wins"),
    Flag(("--disable-cache",), "disable_cache", "on", "phalanxrun keeps no cache of start-up checks"),
)


def _kwargs(kind: str) -> dict[str, Any]:
    """argparse arguments for a flag kind."""
    types: dict[str, Callable[[str], Any]] = {"int": int, "float": float, "str": str}
    if kind in types:
        return {"type": types[kind], "default": None}
    if kind in ("on", "off"):
        return {"action": "store_const", "const": kind == "on", "default": None}
    if kind == "pair":
        return {"type": int, "nargs": 2, "default": None, "metavar": ("MIN", "MAX")}
    return {"type": str.upper, "choices": LOG_LEVELS, "default": None}  # "level"


def add_flags(parser: argparse.ArgumentParser) -> None:
    """Add every horovodrun flag ``parser`` does not define yet: those that act here, then, in a group of
    their own at the end, those accepted so that horovodrun command lines run and that change nothing."""
    acting = parser.add_argument_group("more horovodrun flags")
    noop = parser.add_argument_group(
        "accepted for horovodrun command lines; they change nothing here (each warns once when set)")
    for flag in FLAGS + HOST_FLAGS:
        group, why = (noop, flag.noop) if flag.noop else (acting, flag.doc)
        try:
            group.add_argument(*flag.names, dest=flag.dest, help=why, **_kwargs(flag.kind))
        except argparse.ArgumentError:
            continue  # cli/main.py defines the flag with its own behaviour
    noop.add_argument("--gloo", action="store_true", help="phalanx always runs on gloo (CPU) and NCCL (CUDA)")


def noop_warnings(ns: argparse.Namespace) -> list[str]:
    """One warning per no-op flag that was set (on the command line or by ``--config-file``).

    A switch turned off (``--no-autotune``) asks for what phalanx does anyway and does not warn.
    """
    out: list[str] = []
    seen: set[str] = set()
    for flag in FLAGS + HOST_FLAGS:
        value = getattr(ns, flag.dest, None)
        if flag.noop and flag.dest not in seen and value is not None and value is not False:
            seen.add(flag.dest)
            out.append(f"{flag.names[-1]} changes nothing: {flag.noop}")
    return out


def _nonnegative(ns: argparse.Namespace, dest: str) -> None:
    value = getattr(ns, dest, None)
    if value is not None and value < 0:
        raise InvalidArgumentError(f"--{dest.replace('_', '-')}={value} must be >= 0")


def validate(ns: argparse.Namespace) -> None:
    """horovodrun's checks on the tunable values.

    Raises:
        InvalidArgumentError: a negative count or time, or a noise outside [0, 1].
    """
    for dest in ("fusion_threshold_mb", "cycle_time_ms", "cache_capacity", "autotune_warmup_samples",
                 "autotune_steps_per_sample", "autotune_bayes_opt_max_samples",
                 "stall_check_warning_time_seconds", "stall_check_shutdown_time_seconds", "num_nccl_streams",
                 "thread_affinity", "gloo_timeout_seconds", "elastic_timeout"):
        _nonnegative(ns, dest)
    noise = ns.autotune_gaussian_process_noise
    if noise is not None and not 0 <= noise <= 1:
        raise InvalidArgumentError(f"--autotune-gaussian-process-noise={noise} must be in [0, 1]")


def _flag(value: object) -> str:
    return "1" if value else "0"


def knob_env(ns: argparse.Namespace) -> dict[str, str]:
    """The Horovod variables the ranks get from the effective flags (as horovodrun sets them)."""
    env: dict[str, str] = {}
    pairs: tuple[tuple[str, object, Callable[[Any], str]], ...] = (
        (env_names.HOROVOD_FUSION_THRESHOLD, ns.fusion_threshold_mb, lambda mb: str(mb * 1024 * 1024)),
        (env_names.HOROVOD_STALL_CHECK_DISABLE, ns.no_stall_check, _flag),
        (env_names.HOROVOD_STALL_CHECK_TIME_SECONDS, ns.stall_check_warning_time_seconds, str),
        (env_names.HOROVOD_STALL_SHUTDOWN_TIME_SECONDS, ns.stall_check_shutdown_time_seconds, str),
        (env_names.HOROVOD_GLOO_TIMEOUT_SECONDS, ns.gloo_timeout_seconds, str),
        (env_names.HOROVOD_LOG_LEVEL, ns.log_level, str),
        (env_names.HOROVOD_LOG_HIDE_TIME, ns.log_with_timestamp, lambda with_time: _flag(not with_time)),
        (env_names.NCCL_IB_DISABLE, ns.tcp_flag or None, lambda _: "1"),
        (env_names.PHALANX_ELASTIC_TIMEOUT_S, ns.elastic_timeout, str),
    )
    for name, value, render in pairs:
        if value is not None:
            env[name] = render(value)
    return env
