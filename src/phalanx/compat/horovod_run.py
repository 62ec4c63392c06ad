"""``horovod.run`` under the alias: Horovod 0.28.1's signature, mapped onto :func:`phalanx.run`.

Every parameter name of ``horovod.run`` is accepted. The ones phalanx has are passed on (``num_proc`` is
``np``, ``min_num_proc`` / ``max_num_proc`` the elastic bounds...). The deprecated ``np`` / ``min_np`` /
``max_np`` / ``network_interface`` warn with ``DeprecationWarning`` as in Horovod; ``hostfile`` (Horovod's
``host slots=N`` lines) becomes ``hosts``; a parameter :func:`phalanx.run` takes goes to it as it is
(``ssh_port``, ``ssh_identity_file``, ``network_interfaces``); ``slots`` is ``slots_per_host`` (the slots of
a host listed without its own). One that changes nothing here (``use_mpi``, ``cooldown_range``,
``disable_cache``) warns once, naming itself and the reason; one phalanx cannot honour (another
``executable``) raises :class:`~phalanx.errors.InvalidArgumentError` before any process starts. (Were
``phalanx.run`` without the ssh options, they would warn when every host is this machine and raise for others.)
"""

from __future__ import annotations

import inspect
import sys
import warnings
from collections.abc import Callable
from typing import Any

import phalanx
from phalanx.errors import InvalidArgumentError
from phalanx.launch.api import validate_slots_per_host
from phalanx.launch.hosts import only_this_machine, parse_hostfile, parse_hosts

#: Parameters that change nothing here -> why.
_NOOP = {
    "disable_cache": "phalanx keeps no cache of start-up checks",
    "use_mpi": "phalanx runs on gloo (CPU) and NCCL (CUDA), never MPI; the job runs on gloo",
    "mpi_args": "phalanx runs on gloo (CPU) and NCCL (CUDA), never MPI",
    "cooldown_range": ("phalanx has no blacklist cooldown: a host whose ssh failed, or that failed its check "
                       "when discovery added it, stays out for the rest of the job"),
}
#: ssh-side parameters: nothing to do when every host is this machine; phalanx.run cannot pass them on.
_SSH = ("ssh_port", "ssh_identity_file", "network_interfaces")
#: Parameters phalanx.run may not have -> how to do without.
_UNSUPPORTED = {
    "ssh_port": "phalanx.run has no ssh options: use phalanxrun -p, or a Port line in ~/.ssh/config",
    "ssh_identity_file": "phalanx.run has no ssh options: use phalanxrun -i, or IdentityFile in ~/.ssh/config",
    "network_interfaces": "phalanx.run picks the route to the first remote host: use phalanxrun "
                          "--network-interfaces to choose",
}


def _hosts_from(hosts: str | None, hostfile: str | None, slots: int | None) -> str | None:
    """``hosts`` as it is, or Horovod's hostfile (``host slots=N`` lines; a bare ``host``: ``slots``) as
    ``h1:2,h2:2``."""
    if hostfile is None:
        return hosts
    return ",".join(f"{h.host}:{h.slots}" for h in parse_hostfile(hostfile, validate_slots_per_host(slots) or 1))


def _remote(hosts: str | None, slots: int | None) -> bool:
    return hosts is not None and not only_this_machine(parse_hosts(hosts, default_slots=slots or 1))


def _deprecated(old: str, new: str, old_value: Any, new_value: Any) -> Any:
    if old_value is None:
        return new_value
    warnings.warn(f"{old} is deprecated, use {new} instead", DeprecationWarning, stacklevel=4)
    return old_value


def _extra(given: dict[str, Any], remote: bool) -> dict[str, Any]:
    """The host-side parameters phalanx.run takes; warn for no-ops, refuse what cannot be honoured."""
    accepted = inspect.signature(phalanx.run).parameters
    passed: dict[str, Any] = {}
    for name, value in given.items():
        if value is None or value is False:
            continue
        if name in accepted:
            passed[name] = value
        elif name in _SSH and not remote:
            warnings.warn(f"horovod.run({name}=...) changes nothing: every host is this machine (no ssh)",
                          UserWarning, stacklevel=3)
        elif name in _UNSUPPORTED:
            raise InvalidArgumentError(f"horovod.run({name}={value!r}): {_UNSUPPORTED[name]}")
        else:
            warnings.warn(f"horovod.run({name}=...) changes nothing: {_NOOP[name]}", UserWarning, stacklevel=3)
    return passed


def run(func: Callable[..., Any], args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None,
        num_proc: int | None = 1, min_num_proc: int | None = None, max_num_proc: int | None = None,
        slots: int | None = None, reset_limit: int | None = None, cooldown_range: tuple[int, int] | None = None,
        hosts: str | None = None, hostfile: str | None = None, host_discovery_script: str | None = None,
        start_timeout: float | None = None, ssh_port: int | None = None, ssh_identity_file: str | None = None,
        disable_cache: bool | None = None, output_filename: str | None = None, verbose: bool | None = None,
        use_gloo: bool | None = None, use_mpi: bool | None = None, mpi_args: str | None = None,
        network_interface: str | None = None, network_interfaces: list[str] | None = None,
        executable: str | None = None, np: int | None = None, min_np: int | None = None,
        max_np: int | None = None) -> list[Any]:
    """Run ``func(*args, **kwargs)`` on ``num_proc`` ranks and return their results in rank order.

    Horovod's ``horovod.run``; see the module docstring for how each parameter maps. ``func`` and its
    arguments travel by cloudpickle, as in Horovod.

    Raises:
        ValueError: both ``hosts`` and ``hostfile``, or both ``use_gloo`` and ``use_mpi`` (Horovod's checks).
        InvalidArgumentError: a parameter phalanx cannot honour (the message says what to do instead).
        WorkerFailedError: a rank failed (root cause first).
    """
    num_proc = _deprecated("np", "num_proc", np, num_proc)
    min_num_proc = _deprecated("min_np", "min_num_proc", min_np, min_num_proc)
    max_num_proc = _deprecated("max_np", "max_num_proc", max_np, max_num_proc)
    if network_interface:
        network_interfaces = _deprecated("network_interface", "network_interfaces",
                                         network_interface.split(","), network_interfaces)
    if hosts is not None and hostfile is not None:
        raise InvalidArgumentError("Argument hosts and hostfile only allow one provided.")
    if use_gloo and use_mpi:
        raise InvalidArgumentError("Argument use_gloo and use_mpi only allow one set True.")
    if executable is not None and executable != sys.executable:
        raise InvalidArgumentError(f"horovod.run(executable={executable!r}): phalanx starts ranks with this "
                                   f"interpreter ({sys.executable}); run the driver with the one you want")
    slots = validate_slots_per_host(slots, "slots")
    hosts = _hosts_from(hosts, hostfile, slots)
    extra = _extra({"ssh_port": ssh_port, "ssh_identity_file": ssh_identity_file,
                    "network_interfaces": network_interfaces, "disable_cache": disable_cache,
                    "use_mpi": use_mpi, "mpi_args": mpi_args, "cooldown_range": cooldown_range},
                   _remote(hosts, slots))
    return phalanx.run(func, tuple(args), kwargs, np=num_proc, hosts=hosts, start_timeout=start_timeout,
                       output_filename=output_filename, verbose=bool(verbose), min_np=min_num_proc,
                       max_np=max_num_proc, reset_limit=reset_limit, host_discovery_script=host_discovery_script,
                       slots_per_host=slots, **extra)
