"""Hosts and slots: ``-H h1:2,h2:2``, Horovod's hostfile (``host slots=N``) and where each rank goes.

A host named without its slots (``-H h1``, a hostfile line ``h1``, a discovery script's line ``h1``) has
``--slots-per-host`` slots, else one; slots given with the host always win (Horovod's rule for the discovery
script's lines, applied to every host list).

Placement is horovodrun's: ranks fill the first host's slots in order, then the next host's, so ranks of
one host are contiguous and local/cross ranks follow (:func:`phalanx.env.assign_ranks`).
"""

from __future__ import annotations

import re
import socket
from collections.abc import Sequence
from dataclasses import dataclass

from phalanx.errors import InvalidArgumentError

_LOOPBACK_NAMES = {"localhost", "localhost.localdomain", "ip6-localhost"}
# RFC 1123 host names, IPv4 addresses and bracket-less IPv6 addresses: nothing else becomes an ssh argument.
_HOST_RE = re.compile(r"^[A-Za-z0-9_]([A-Za-z0-9._-]{0,252})$|^[0-9A-Fa-f:.]{2,45}$")
_HOSTFILE_SLOTS_RE = re.compile(r"^slots=(\d+)$")


@dataclass(frozen=True)
class HostSlots:
    """One host and how many ranks it may run."""

    host: str
    slots: int


def check_host_name(host: str, where: str) -> str:
    """Check that ``host`` is a plain host name or address (never an ssh option or a shell word).

    Raises:
        InvalidArgumentError: an empty or malformed name.
    """
    if not _HOST_RE.match(host) or host.startswith("-"):
        raise InvalidArgumentError(
            f"{where}: {host!r} is not a host name or address (letters, digits, '.', '-', '_'; IPv6 without "
            "brackets)"
        )
    return host


def _slots(text: str, host: str, where: str) -> int:
    if not text.isdigit() or int(text) <= 0:
        raise InvalidArgumentError(f"{where}: host {host!r} has slots {text!r}; give a positive integer")
    return int(text)


def parse_hosts(text: str, where: str = "-H/--hosts", default_slots: int = 1) -> list[HostSlots]:
    """Parse ``h1:2,h2:2``; a host without ``:N`` has ``default_slots`` (``--slots-per-host``, else one).

    Raises:
        InvalidArgumentError: an empty entry, a bad slot count, a bad name or a host named twice.
    """
    out: list[HostSlots] = []
    for item in text.split(","):
        item = item.strip()
        if not item:
            raise InvalidArgumentError(f"{where}={text!r} has an empty entry; give host:slots,host:slots")
        host, sep, count = item.rpartition(":") if item.count(":") == 1 else (item, "", "")
        if not sep:
            host, count = item, str(default_slots)
        out.append(HostSlots(check_host_name(host, where), _slots(count, host, where)))
    return _no_duplicates(out, where)


def parse_hostfile(path: str, default_slots: int = 1) -> list[HostSlots]:
    """Parse Horovod's hostfile: one ``host slots=N`` (or ``host``: ``default_slots``, ``--slots-per-host``,
    else one) per line; ``#`` comments.

    Raises:
        InvalidArgumentError: the file cannot be read, or a line is malformed (its number is named).
    """
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except OSError as e:
        raise InvalidArgumentError(f"--hostfile {path!r} cannot be read: {e.strerror}") from e
    except UnicodeDecodeError as e:
        raise InvalidArgumentError(f"--hostfile {path!r} is not a text file (byte {e.start} is not UTF-8): give "
                                   "a file of 'host slots=N' lines") from e
    out: list[HostSlots] = []
    for number, raw in enumerate(lines, 1):
        words = raw.split("#", 1)[0].split()
        if not words:
            continue
        where = f"--hostfile {path}:{number}"
        match = _HOSTFILE_SLOTS_RE.match(words[1]) if len(words) == 2 else None
        if len(words) > 2 or (len(words) == 2 and match is None):
            raise InvalidArgumentError(f"{where}: {raw.strip()!r} is not 'host slots=N'")
        slots = _slots(match.group(1), words[0], where) if match else default_slots
        out.append(HostSlots(check_host_name(words[0], where), slots))
    if not out:
        raise InvalidArgumentError(f"--hostfile {path!r} names no host; write one 'host slots=N' per line")
    return _no_duplicates(out, f"--hostfile {path}")


def _no_duplicates(hosts: list[HostSlots], where: str) -> list[HostSlots]:
    seen: set[str] = set()
    for h in hosts:
        if h.host in seen:
            raise InvalidArgumentError(f"{where}: host {h.host!r} is named twice; give its slots once")
        seen.add(h.host)
    return hosts


def place(hosts: Sequence[HostSlots], np: int) -> list[str]:
    """The host of each rank, in rank order: each host's slots filled in turn (horovodrun's placement).

    Raises:
        InvalidArgumentError: ``np`` is more than the slots of all hosts.
    """
    total = sum(h.slots for h in hosts)
    if np > total:
        listed = ",".join(f"{h.host}:{h.slots}" for h in hosts)
        raise InvalidArgumentError(f"np={np} is more than the {total} slot(s) of the hosts {listed}; "
                                   f"lower -np or add slots")
    out: list[str] = []
    for h in hosts:
        out.extend([h.host] * min(h.slots, np - len(out)))
    return out


def is_local(host: str) -> bool:
    """Whether ``host`` is this machine: a loopback name or address, this machine's hostname, or a name
    whose address is assigned to one of this machine's interfaces (binding to it succeeds)."""
    if host in _LOOPBACK_NAMES or host == socket.gethostname() or host == socket.getfqdn():
        return True
    try:
        infos = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
    except OSError:
        return False
    for family, _type, _proto, _name, addr in infos:
        with socket.socket(family, socket.SOCK_STREAM) as s:
            try:
                s.bind((addr[0], 0))
            except OSError:
                continue
            return True
    return False


def only_this_machine(hosts: Sequence[HostSlots]) -> bool:
    """True when every host is this machine (the job needs no ssh and listens on loopback).

    Raises:
        InvalidArgumentError: a host that is not this machine does not resolve (named, before anything starts).
    """
    local = True
    for h in hosts:
        if is_local(h.host):
            continue
        local = False
        try:
            socket.getaddrinfo(h.host, None, proto=socket.IPPROTO_TCP)
        except OSError as e:
            raise InvalidArgumentError(f"host {h.host!r} does not resolve ({e}); check -H/--hostfile") from e
    return local
