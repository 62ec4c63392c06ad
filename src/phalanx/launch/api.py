"""Public entry points of the local launcher: ``phalanx.run`` and the validation shared with the CLI."""

from __future__ import annotations

import logging
import math
import os
import socket
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from phalanx.env import settings
from phalanx.errors import InvalidArgumentError
from phalanx.job.elastic_policy import ElasticPolicy
from phalanx.job.payload import serialize_call
from phalanx.job.report import entry_point
from phalanx.job.shipping import shipped_payload
from phalanx.launch import warm
from phalanx.launch.core import JobSpec, start_timeout_hint
from phalanx.launch.discovery import HostDiscovery, check_script
from phalanx.launch.elastic_hosts import ElasticHostsLauncher
from phalanx.launch.elasticity import ElasticLocalLauncher, ElasticSpec
from phalanx.launch.hosts import HostSlots, check_host_name, only_this_machine, parse_hostfile, parse_hosts, place
from phalanx.launch.local import LocalLauncher
from phalanx.launch.remote import HostsLauncher, HostsSpec
from phalanx.launch.ssh import SshOptions
from phalanx.observe import resolve as resolve_observe

#: The most ranks one job may have: a bound far above any real job, checked before anything is allocated
#: per rank (``np=10**20`` would otherwise grow the driver by gigabytes before failing).
MAX_NP = 1 << 16


def validate_np(np: object, name: str = "np") -> int:
    """Check a process count.

    Raises:
        InvalidArgumentError: not an int, or not positive.
    """
    if isinstance(np, bool) or not isinstance(np, int):
        raise InvalidArgumentError(f"{name} must be a positive int; got {np!r} of type {type(np).__name__}")
    if np <= 0:
        raise InvalidArgumentError(f"{name} must be a positive int (the number of ranks); got {np}")
    if np > MAX_NP:
        raise InvalidArgumentError(f"{name}={np} is more ranks than phalanx launches (at most {MAX_NP}); give the "
                                   "number of processes to start, e.g. one per GPU or core of each host")
    return np


def resolve_start_timeout(start_timeout: float | None, environ: Mapping[str, str] | None = None, *,
                          spark: bool = False) -> float:
    """The start timeout in seconds: the argument, else ``HOROVOD_START_TIMEOUT``, else 30. On Spark
    (``spark``), as ``horovod.spark.run``: the argument, else ``HOROVOD_SPARK_START_TIMEOUT``, else
    ``HOROVOD_START_TIMEOUT`` if set, else 600 (the time covers Spark scheduling the barrier tasks, and
    executors started on demand can take minutes).

    Raises:
        InvalidArgumentError: not a positive number.
    """
    if start_timeout is None:
        setting = settings.HOROVOD_START_TIMEOUT
        if spark and (settings.HOROVOD_SPARK_START_TIMEOUT.is_set(environ) or not setting.is_set(environ)):
            setting = settings.HOROVOD_SPARK_START_TIMEOUT
        value = setting.get(environ)
        if not math.isfinite(value):
            raise InvalidArgumentError(f"{setting.name}={value:g}: give a finite number of seconds, e.g. 60")
        return value
    try:
        value = float(start_timeout)
    except (TypeError, ValueError) as e:
        raise InvalidArgumentError(f"start_timeout must be a number of seconds; got {start_timeout!r}") from e
    if not math.isfinite(value) or value <= 0:
        raise InvalidArgumentError(f"start_timeout must be a positive, finite number of seconds (e.g. 60); "
                                   f"got {value:g}")
    return value


def validate_env(env: Mapping[str, object] | None) -> dict[str, str]:
    """Check the user's extra environment: string names and string values.

    Raises:
        InvalidArgumentError: a name or value is not a string.
    """
    if env is None:
        return {}
    if not isinstance(env, Mapping):
        raise InvalidArgumentError(f"env must be a dict of str to str; got {type(env).__name__}")
    bad = {k: v for k, v in env.items() if not isinstance(k, str) or not isinstance(v, str)}
    if bad:
        raise InvalidArgumentError(f"env must map str to str; these entries are not strings: {bad!r}")
    return dict(env)  # type: ignore[arg-type]


def validate_slots_per_host(slots: object, name: str = "slots_per_host") -> int | None:
    """Check horovodrun's ``--slots-per-host`` (None: not given).

    Raises:
        InvalidArgumentError: not a whole number of at least 1.
    """
    if slots is None:
        return None
    if isinstance(slots, bool) or not isinstance(slots, int) or slots < 1:
        raise InvalidArgumentError(f"{name}={slots!r}: give the ranks one host may run, a whole number >= 1 "
                                   "(it applies to hosts listed without their slots)")
    return slots


def slots_per_host_unused(slots: int | None, any_hosts: bool, flag: str = "--slots-per-host",
                          sources: str = "-H, --hostfile or --host-discovery-script") -> str | None:
    """Why ``--slots-per-host`` changes nothing, when the job names no host (``any_hosts`` False): as with
    horovodrun (``localhost:np``), every rank then runs on this machine."""
    if slots is None or any_hosts:
        return None
    return (f"{flag} changes nothing without {sources}: every rank runs on this machine; it gives slots to "
            "the hosts listed without theirs")


def resolve_hosts(hosts: str | None, np: int, hostfile: str | None = None,
                  slots_per_host: int | None = None) -> list[HostSlots] | None:
    """The job's hosts from ``-H``/``hosts=`` or ``--hostfile`` (a host listed without its slots has
    ``slots_per_host``, else one); None when the job runs on this machine only.

    Raises:
        InvalidArgumentError: both given, a malformed entry, or fewer slots than ``np`` (before any process
            starts).
    """
    if hosts is not None and hostfile is not None:
        raise InvalidArgumentError("give -H/--hosts or --hostfile, not both")
    if hosts is None and hostfile is None:
        return None
    default = slots_per_host or 1
    parsed = parse_hosts(hosts, default_slots=default) if hosts is not None else parse_hostfile(str(hostfile), default)
    place(parsed, np)
    return None if only_this_machine(parsed) else parsed


def discovered_hosts(script: str, slots_per_host: int | None = None) -> list[HostSlots] | None:
    """The hosts of an elastic job given ``--host-discovery-script`` and no ``-H`` (horovodrun's usual
    command): the script's first listing, as ``-H`` would give it; None when every host listed is this
    machine. A host that does not resolve is left to the launcher, which checks every host discovery adds
    and leaves a failing one out with one warning naming it.

    Raises:
        InvalidArgumentError: the script failed or listed no host with slots.
    """
    found = HostDiscovery(script, lambda _hosts: None, default_slots=slots_per_host or 1).poll() or {}
    hosts = [HostSlots(check_host_name(h, "host discovery"), n) for h, n in found.items() if n > 0]
    if not hosts:
        raise InvalidArgumentError(f"--host-discovery-script {script}: its first run listed no host with slots "
                                   "(it must print host:slots lines; its failure, if any, is logged above)")
    usable = [h for h in hosts if _resolves(h.host)]
    return None if only_this_machine(usable) else usable


def _resolves(host: str) -> bool:
    try:
        socket.getaddrinfo(host, None)
    except OSError:
        return False
    return True


def hosts_spec(hosts: list[HostSlots], ssh_port: int | None, identity_file: str | None,
               interfaces: str | Sequence[str] | None, start_timeout_s: float, python: str | None = None,
               forward_env: Mapping[str, str] | None = None) -> HostsSpec:
    """The multi-host part of a job, its ssh options checked.

    Raises:
        InvalidArgumentError: a port outside 1-65535, or an identity file that does not exist.
    """
    if ssh_port is not None and (isinstance(ssh_port, bool) or not isinstance(ssh_port, int)
                                 or not 0 < ssh_port < 65536):
        raise InvalidArgumentError(f"ssh port {ssh_port!r} is not a port number (1-65535)")
    if identity_file is not None and not os.path.isfile(identity_file):
        raise InvalidArgumentError(f"ssh identity file {identity_file!r} does not exist")
    names = interfaces.split(",") if isinstance(interfaces, str) else list(interfaces or ())
    nics = tuple(n.strip() for n in names if n.strip())
    ssh = SshOptions(ssh_port, identity_file, min(start_timeout_s, 30.0))
    return HostsSpec(hosts=tuple(hosts), ssh=ssh, interfaces=nics, python=python, forward_env=dict(forward_env or {}))


def validate_hosts(hosts: str | None, np: int) -> None:
    """Check a ``hosts`` string (``h1:2,h2:2``) against ``np``.

    Raises:
        InvalidArgumentError: a malformed entry, or fewer slots than ``np``.
    """
    if hosts is not None:
        place(parse_hosts(hosts), np)


@entry_point("phalanx.run")
def run(
    fn: Callable[..., Any],
    args: tuple[Any, ...] = (),
    kwargs: dict[str, Any] | None = None,
    np: int = 1,
    *,
    hosts: str | None = None,
    env: Mapping[str, str] | None = None,
    start_timeout: float | None = None,
    output_filename: str | None = None,
    prefix_output: bool = True,
    verbose: bool = False,
    quiet: bool = False,
    min_np: int | None = None,
    max_np: int | None = None,
    reset_limit: int | None = None,
    host_discovery_script: str | None = None,
    ssh_port: int | None = None,
    ssh_identity_file: str | None = None,
    network_interfaces: str | Sequence[str] | None = None,
    slots_per_host: int | None = None,
    dashboard: bool | int | str | None = None,
    mlflow: bool | None = None,
) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` on ``np`` local processes; the contract of ``horovod.run``.

    Every rank is a fresh interpreter with the worker contract in its environment (``RANK``,
    ``WORLD_SIZE``, ``MASTER_ADDR``... and ``HOROVOD_*``), so ``hvd.init()`` and
    ``torch.distributed.init_process_group("gloo")`` work unchanged. Output is streamed live, prefixed
    ``[rank]<stdout>:``.

    Args:
        fn: the function; it and its arguments travel by cloudpickle (``__main__`` functions work).
        args: positional arguments for ``fn``.
        kwargs: keyword arguments for ``fn``.
        np: number of ranks (> 0).
        hosts: ``"h1:2,h2:2"``: run on these hosts, each host's slots filled in turn (horovodrun's
            placement). Hosts other than this machine are reached with the system ``ssh`` client
            (BatchMode) and need the same interpreter path and phalanx; the modules beside the driver's
            script are shipped to them, as ``phalanx.spark`` does; see docs/hosts.md.
        env: extra environment variables for every rank.
        start_timeout: seconds every rank has to start (default: ``HOROVOD_START_TIMEOUT`` or 30).
        output_filename: also keep each rank's output in ``DIR/rank.N/{stdout,stderr}``.
        prefix_output: prefix each output line with ``[rank]<stream>:`` (default True).
        verbose: log the launcher's steps at INFO level.
        quiet: do not say on stderr what the start waits for (the warm-start template, ``ranks started
            k/N``; on a terminal one updating line, elsewhere plain ``phalanx:`` lines); ``phalanxrun -q``.
        min_np: elastic job: the fewest workers it may go on with. Giving any of ``min_np``, ``max_np``
            or ``reset_limit`` makes the job elastic: a lost worker is replaced and the world re-forms
            (``hvd.elastic.run``; see docs/elastic.md).
        max_np: elastic job: the most workers (default ``np``).
        reset_limit: elastic job: the most re-formations before the job fails (default: no limit).
        host_discovery_script: elastic job: an executable printing ``host:slots`` lines, polled every
            second; when the slots grow, workers are added up to ``max_np`` and running ranks get
            ``HostsUpdatedInterrupt`` at their next ``commit()``. Without ``hosts`` only this machine's
            names count; with ``hosts`` every listed host does: a host new to the job is checked over
            ssh first (left out, with a warning, if it fails), and a host that leaves the list has its
            workers stopped (the world re-forms on the others).
        ssh_port: with ``hosts`` naming other machines: the ssh port (default: ssh's own).
        ssh_identity_file: with ``hosts`` naming other machines: the ssh private key.
        network_interfaces: with ``hosts`` naming other machines: the NIC (a name, a comma-separated
            list or a list; the first is used) whose address the job's channel and store listen on
            (default: this machine's address on the route to the first other host).
        slots_per_host: the ranks a host may run when ``hosts`` or the discovery script's line names it
            without its slots (horovodrun's ``--slots-per-host``; slots given with a host win). Without
            ``hosts`` or ``host_discovery_script`` it changes nothing (a warning says so): every rank runs
            here.
        dashboard: serve the job's live page and its Prometheus ``/metrics`` from this process: ``True`` (a
            free port on 127.0.0.1), a port, or ``"HOST:PORT"``; the address, with its token, is printed once
            (default: ``PHALANX_DASHBOARD``, else off; see docs/observe.md).
        mlflow: log the job's metrics (rank 0's) and timeline summary to this thread's active MLflow run
            (default: ``PHALANX_MLFLOW``, else off).

    Returns:
        Every rank's return value, in rank order (for an elastic job: the final world's).

    Raises:
        InvalidArgumentError: a bad argument (checked before any process starts).
        PayloadError: ``fn`` or an argument cannot be pickled (the message names the object).
        WorkerFailedError: a rank failed; the root-cause rank, its traceback and log tail come first.
        StartTimeoutError: ranks did not start in time; the message names them.
    """
    np = validate_np(np)
    slots_per_host = validate_slots_per_host(slots_per_host)
    unused = slots_per_host_unused(slots_per_host, hosts is not None or host_discovery_script is not None,
                                   "phalanx.run(slots_per_host=...)", "hosts or host_discovery_script")
    if unused is not None:
        warnings.warn(unused, UserWarning, stacklevel=3)
    remote = resolve_hosts(hosts, np, slots_per_host=slots_per_host)
    # Across hosts the driver-local modules travel with the call, as on Spark (phalanx.job.shipping).
    pack = serialize_call if remote is None else shipped_payload
    spec = JobSpec(
        np=np,
        payload=pack(fn, tuple(args), dict(kwargs or {})),
        env=validate_env(env),
        start_timeout_s=resolve_start_timeout(start_timeout),
        start_timeout_hint=start_timeout_hint("start_timeout="),
        prefix=prefix_output,
        output_dir=output_filename,
        warm_preload=warm.preload_for(fn),
        observe=resolve_observe(dashboard, mlflow),
        progress=not quiet,
    )
    if verbose:
        logging.getLogger("phalanx").setLevel(logging.DEBUG)
    elastic = elastic_spec(np, min_np, max_np, reset_limit, spec.env, host_discovery_script, slots_per_host)
    if remote is not None:
        where = hosts_spec(remote, ssh_port, ssh_identity_file, network_interfaces, spec.start_timeout_s)
        return (ElasticHostsLauncher(spec, elastic, where) if elastic else HostsLauncher(spec, where)).run()
    return (ElasticLocalLauncher(spec, elastic) if elastic else LocalLauncher(spec)).run()


def elastic_spec(np: int, min_np: int | None, max_np: int | None, reset_limit: int | None,
                 env: Mapping[str, str] | None = None, discovery_script: str | None = None,
                 slots_per_host: int | None = None) -> ElasticSpec | None:
    """The elastic part of a job, or None when none of ``min_np``/``max_np``/``reset_limit`` (or a host
    discovery script) is given.

    Raises:
        InvalidArgumentError: a bad count, ``min_np > np``, a bad ``PHALANX_ELASTIC_TIMEOUT_S``, or a
            discovery script that is not an executable file.
    """
    if min_np is None and max_np is None and reset_limit is None and discovery_script is None:
        return None
    script = check_script(discovery_script) if discovery_script is not None else None
    lo = validate_np(min_np, "min_np") if min_np is not None else 1
    hi = validate_np(max_np, "max_np") if max_np is not None else max(np, lo)
    if not lo <= np <= hi:
        raise InvalidArgumentError(f"elastic job needs min_np <= np <= max_np; got {lo} <= {np} <= {hi}")
    if reset_limit is not None and (isinstance(reset_limit, bool) or not isinstance(reset_limit, int)):
        raise InvalidArgumentError(f"reset_limit must be an int >= 0 or None; got {reset_limit!r}")
    given = settings.ELASTIC_TIMEOUT.is_set(env or {})
    timeout = settings.ELASTIC_TIMEOUT.get(env if given else None)
    return ElasticSpec(ElasticPolicy(lo, hi, reset_limit), timeout, script, slots_per_host or 1)
