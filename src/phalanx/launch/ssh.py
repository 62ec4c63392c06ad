"""Reaching other hosts: the system ``ssh`` client (as horovodrun uses it) and the driver's address.

ssh runs in BatchMode (no password or passphrase prompt ever blocks a job) and with horovodrun's
``StrictHostKeyChecking=no``. Nothing secret is put on its command line; the remote command is built
from validated names and quoted for the remote shell.
"""

from __future__ import annotations

import fcntl
import math
import os
import shlex
import socket
import struct
import subprocess
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from phalanx.errors import InvalidArgumentError, PhalanxError

_SIOCGIFADDR = 0x8915
#: Lines of a failed ssh's error output kept in the error that names its host.
_ERROR_LINES = 5


@dataclass(frozen=True)
class SshOptions:
    """How to reach the hosts.

    Attributes:
        port: the ssh port (``-p/--ssh-port``); None: ssh's own default or config.
        identity_file: the private key (``-i/--ssh-identity-file``); None: ssh's defaults.
        connect_timeout_s: seconds ssh may take to connect (ssh's ``ConnectTimeout``).
    """

    port: int | None = None
    identity_file: str | None = None
    connect_timeout_s: float = 10.0


def ssh_argv(host: str, options: SshOptions, remote_command: str) -> list[str]:
    """The ``ssh`` command line that runs ``remote_command`` on ``host`` (a validated name)."""
    argv = ["ssh", "-T", "-o", "BatchMode=yes", "-o", "StrictHostKeyChecking=no",
            "-o", f"ConnectTimeout={max(1, math.ceil(options.connect_timeout_s))}", "-o", "LogLevel=ERROR"]
    if options.port is not None:
        argv += ["-p", str(options.port)]
    if options.identity_file is not None:
        argv += ["-i", options.identity_file]
    return [*argv, host, remote_command]


def agent_command(python: str, cwd: str) -> str:
    """The remote shell command that starts the host agent in the job's working directory."""
    return f"cd {shlex.quote(cwd)} && exec {shlex.quote(python)} -m phalanx.launch.host_agent"


#: The host check's exit code when the job's working directory is missing on the host.
NO_WORKDIR = 97


def _probe_command(python: str, cwd: str) -> str:
    code = "import phalanx.launch.host_agent, socket; print(socket.gethostname())"
    return f"cd {shlex.quote(cwd)} 2>/dev/null || exit {NO_WORKDIR}; exec {shlex.quote(python)} -c {shlex.quote(code)}"


def _check_one(host: str, options: SshOptions, python: str, timeout_s: float) -> str | None:
    cwd = os.getcwd()
    argv = ssh_argv(host, options, _probe_command(python, cwd))
    try:
        done = subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return f"host {host!r} did not answer over ssh within {timeout_s:g} s (raise --start-timeout)"
    except OSError as e:
        return f"the ssh client could not be started for host {host!r}: {e}"
    if done.returncode == 0:
        return None
    if done.returncode == NO_WORKDIR:
        return (f"host {host!r}: the working directory {cwd} does not exist there (each rank starts in the "
                "driver's working directory: create it on that host, or start phalanxrun from a directory every "
                "host has)")
    tail = "\n    ".join(done.stderr.strip().splitlines()[-_ERROR_LINES:]) or "(no error output)"
    cause = ("ssh could not connect or log in" if done.returncode == 255
             else f"{python} -m phalanx.launch.host_agent cannot run there "
                  "(is phalanx installed for that interpreter?)")
    return f"host {host!r}: {cause} (exit code {done.returncode}):\n    {tail}"


def host_problems(hosts: Sequence[str], options: SshOptions, python: str, timeout_s: float) -> dict[str, str]:
    """Check, in parallel, that every host answers over ssh, has the working directory and imports phalanx
    with ``python``.

    Returns:
        host -> what failed there (the host named, the cause and ssh's last error lines), for the hosts that
        failed; empty when all passed. Returns within ``timeout_s`` (plus ssh's start).
    """
    if not hosts:
        return {}
    with ThreadPoolExecutor(max_workers=min(32, len(hosts))) as pool:
        results = list(pool.map(lambda h: _check_one(h, options, python, timeout_s), hosts))
    return {host: problem for host, problem in zip(hosts, results, strict=True) if problem is not None}


def check_hosts(hosts: Sequence[str], options: SshOptions, python: str, timeout_s: float) -> None:
    """Check, in parallel, that every host answers over ssh, has the working directory and imports phalanx
    with ``python``.

    Raises:
        PhalanxError: one message naming every host that failed and why, within ``timeout_s``.
    """
    problems = host_problems(hosts, options, python, timeout_s)
    if problems:
        raise PhalanxError("host check failed:\n  " + "\n  ".join(problems.values()))


def interface_address(name: str) -> str:
    """The IPv4 address of network interface ``name`` (``--network-interfaces``).

    Raises:
        InvalidArgumentError: no such interface, or it has no IPv4 address.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            packed = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
        except OSError as e:
            raise InvalidArgumentError(
                f"--network-interfaces {name!r}: no such interface with an IPv4 address on this machine ({e.strerror})"
            ) from e
    return socket.inet_ntoa(packed[20:24])


def route_address(host: str) -> str:
    """The address of this machine on the route to ``host`` (a UDP connect sends nothing).

    Raises:
        InvalidArgumentError: ``host`` does not resolve, or no route leads to it.
    """
    try:
        family, _t, _p, _n, addr = socket.getaddrinfo(host, 9, proto=socket.IPPROTO_UDP)[0]
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.connect(addr)
            return str(s.getsockname()[0])
    except OSError as e:
        raise InvalidArgumentError(
            f"host {host!r}: cannot resolve it or find a route to it ({e}); check the name, or give "
            "--network-interfaces"
        ) from e
