"""Processes of this machine: who is at the other end of a Unix socket, and whether a pid still names the
process it named (pids are reused)."""

from __future__ import annotations

import socket
import struct


def peer_credentials(sock: socket.socket) -> tuple[int, int]:
    """The pid and uid of the process at the other end of a Unix socket (``SO_PEERCRED``)."""
    pid, uid, _ = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))
    return pid, uid


def start_time(pid: int) -> int | None:
    """When ``pid`` started (clock ticks after boot, ``/proc/PID/stat`` field 22), or None when it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    # The command name (field 2) may hold spaces and parentheses: fields are counted after its last ")".
    return int(stat[stat.rindex(b")") + 2:].split()[19])
