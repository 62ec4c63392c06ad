"""``python -m phalanx.worker.template_shared FD OWNER_PID OWNER_START MODULE...``: one warm template shared by the
processes of one owner (a Spark executor's python workers), forking the ranks they ask for.

The template of :mod:`phalanx.worker.template` serves the one launcher that started it; this one serves any
process of the same user that connects to its listening socket ``FD`` (inherited: its starter bound the
abstract name, so two starters cannot both win), and lives as long as its *owner*, the process
``OWNER_PID`` (started at ``OWNER_START``, clock ticks after boot, so a reused pid is not mistaken for it).
The protocol is the single template's, per connection, with ranks forked by the same code (the same
independence: own session, environment, generators, no threads; see ``template._become_rank``).

Invariants:

- Only a peer of this user is served (``SO_PEERCRED``), and every request is validated before use: a spawn
  names an integer id, a string-to-string environment and an absolute working directory, with exactly two
  descriptors; nothing else is accepted (no command: only the function worker runs; no pickle).
- A rank belongs to the connection that asked for it: its exit is reported there, and when that connection
  closes (its process ended or was killed), the rank's process group is killed.
- When the owner ends, the template kills every rank it forked and exits: it never outlives its executor.
"""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import sys
from typing import Any

from phalanx.errors import InvalidArgumentError
from phalanx.job.local_peer import peer_credentials, start_time
from phalanx.worker.lifeline import set_process_name
from phalanx.worker.template import MAX_MESSAGE_BYTES, REAP_INTERVAL_S, fork_rank, preload, reap, send

#: Seconds between checks of the owner where the kernel has no pidfd (Linux < 5.3).
OWNER_POLL_S = 1.0
#: Seconds a connection may block the template on a reply before it is dropped.
SEND_TIMEOUT_S = 5.0
_SPAWN_KEYS = frozenset({"spawn", "env", "cwd", "python"})


def _text(value: object) -> bool:
    return isinstance(value, str) and "\0" not in value


def spawn_request(data: bytes) -> dict[str, Any]:
    """A spawn request, checked; raises InvalidArgumentError (a ValueError) naming what is wrong."""
    message = json.loads(data)
    if not isinstance(message, dict) or not set(message) <= _SPAWN_KEYS:
        keys = sorted(message) if isinstance(message, dict) else None
        raise InvalidArgumentError(f"not a spawn request (keys {keys})")
    ident, env, cwd = message.get("spawn"), message.get("env"), message.get("cwd")
    if not isinstance(ident, int) or isinstance(ident, bool):
        raise InvalidArgumentError(f"spawn id {ident!r} is not an integer")
    if message.get("python") is not None:
        raise InvalidArgumentError("a shared template forks the function worker only, never a command")
    if not isinstance(env, dict) or not all(_text(k) and k and "=" not in k and _text(v) for k, v in env.items()):
        raise InvalidArgumentError("the environment is not a map of variable names to strings")
    if not isinstance(cwd, str) or not _text(cwd) or not os.path.isabs(cwd):
        raise InvalidArgumentError(f"working directory {cwd!r} is not an absolute path")
    return {"spawn": ident, "env": env, "cwd": cwd, "python": None}


class Owner:
    """The process whose life bounds the template's: readable (a pidfd) or polled once it may have ended."""

    def __init__(self, pid: int, started: int) -> None:
        self.pid, self.started = pid, started
        self.fd: int | None = None
        try:
            self.fd = os.pidfd_open(pid)
        except (AttributeError, OSError):
            self.fd = None
        # checked after the pidfd is open: the pid may have been reused before, never after
        self._replaced = start_time(pid) != started

    def fds(self) -> list[int]:
        """The descriptors a forked rank must close."""
        return [] if self.fd is None else [self.fd]

    def gone(self) -> bool:
        """True when the owner ended (or its pid now names another process)."""
        if self._replaced:
            return True
        if self.fd is not None:  # readable once the process ended; it names that process only
            return bool(select.select([self.fd], [], [], 0)[0])
        return start_time(self.pid) != self.started


class Server:
    """The template's connections and the ranks each one owns."""

    def __init__(self, listener: socket.socket, owner: Owner) -> None:
        self.listener = listener
        self.owner = owner
        self.clients: dict[int, socket.socket] = {}  # by descriptor
        self.ranks: dict[int, socket.socket] = {}  # rank pid -> the connection that asked for it
        self.uid = os.getuid()

    def serve(self) -> None:
        """Answer connections and spawn requests until the owner ends; then kill every rank."""
        try:
            while not self.owner.gone():
                waits: list[Any] = [self.listener, *self.clients.values()]
                if self.owner.fd is not None:
                    waits.append(self.owner.fd)
                readable, _, _ = select.select(waits, [], [], REAP_INTERVAL_S if self.ranks else OWNER_POLL_S)
                for ready in readable:
                    if ready is self.listener:
                        self._accept()
                    elif isinstance(ready, socket.socket):
                        self._request(ready)
                reap(self._exited)
        finally:
            for pid in list(self.ranks):
                _kill_group(pid)

    def _accept(self) -> None:
        try:
            conn, _ = self.listener.accept()
        except OSError:
            return
        try:
            uid = peer_credentials(conn)[1]
        except OSError:
            uid = -1
        if uid != self.uid:
            conn.close()
            return
        conn.settimeout(SEND_TIMEOUT_S)
        self.clients[conn.fileno()] = conn
        self._send(conn, {"ready": True, "pid": os.getpid()})

    def _request(self, conn: socket.socket) -> None:
        try:
            data, fds, _, _ = socket.recv_fds(conn, MAX_MESSAGE_BYTES, 2)
        except OSError:
            data, fds = b"", []
        if not data:
            self._drop(conn)
            return
        try:
            if len(fds) != 2:
                raise InvalidArgumentError(f"a spawn request carries 2 descriptors (stdout, stderr), not {len(fds)}")
            message = spawn_request(data)
        except ValueError as e:
            for fd in fds:
                os.close(fd)
            self._send(conn, {"refused": str(e)})
            return
        pid = fork_rank(message, fds, [self.listener, *self.clients.values(), *self.owner.fds()])
        self.ranks[pid] = conn
        self._send(conn, {"spawned": message["spawn"], "pid": pid})

    def _exited(self, pid: int, returncode: int) -> None:
        conn = self.ranks.pop(pid, None)
        if conn is not None and conn.fileno() in self.clients:
            self._send(conn, {"exited": pid, "returncode": returncode})

    def _send(self, conn: socket.socket, message: dict[str, Any]) -> None:
        try:
            send(conn, message)
        except OSError:
            self._drop(conn)

    def _drop(self, conn: socket.socket) -> None:
        """The connection ended: its ranks lose their owner and die."""
        if self.clients.pop(conn.fileno(), None) is None:
            return
        for pid, owner in list(self.ranks.items()):
            if owner is conn:
                _kill_group(pid)
        conn.close()


def _kill_group(pid: int) -> None:
    """SIGKILL a rank and its process group (a rank leads its own session)."""
    for kill, target in ((os.killpg, pid), (os.kill, pid)):
        try:
            kill(target, signal.SIGKILL)
        except OSError:
            continue


def main(argv: list[str]) -> int:
    """Entry point: ``FD OWNER_PID OWNER_START MODULE...``."""
    listener = socket.socket(fileno=int(argv[0]))
    owner = Owner(int(argv[1]), int(argv[2]))
    set_process_name("phalanx-tmpl")
    if owner.gone():
        return 0
    preload(argv[3:])
    Server(listener, owner).serve()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
