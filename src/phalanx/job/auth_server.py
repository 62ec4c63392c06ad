"""A listening socket that serves a connection only once the peer proved it holds the job's secret.

The common core of the driver's channel (:mod:`phalanx.job.channel`) and the job's store
(:mod:`phalanx.job.store`). Each accepted connection gets a thread of its own, which runs the handshake
(:mod:`phalanx.job.handshake`: a challenge each way, one deadline for the whole exchange) and then the
owner's handler. At most :data:`MAX_PENDING_HANDSHAKES` connections may be in their handshake at once
(each holds a thread for at most the deadline); further ones are closed on arrival, and clients retry.
The accepting thread survives any error but the server's own :meth:`AuthServer.close`.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Callable

from phalanx.errors import ChannelError
from phalanx.job import handshake
from phalanx.job.framing import close_socket
from phalanx.job.handshake import Role

log = logging.getLogger(__name__)

#: Connections that may be in their handshake at once; more are closed on arrival.
MAX_PENDING_HANDSHAKES = 32
ACCEPTER_JOIN_S = 5.0  # close() waits this long for the accepting thread to end (it is woken at once)
_ACCEPT_RETRY_S = 0.05  # pause after a failed accept (EMFILE, ENOBUFS) before the next one

#: Serves one authenticated peer, (rank, role), until it returns; the connection is closed afterwards.
Handler = Callable[[socket.socket, tuple[int, Role]], None]


class AuthServer:
    """Listens on ``bind_host`` (a free port, bound on construction) and hands each authenticated
    connection to ``handle`` on the connection's thread. Accepting starts at once: build it last.

    Args:
        secret: the job's secret (hex).
        bind_host: address to listen on.
        admit: whether a (rank, role) may connect at all (checked before its proof).
        handle: serves an authenticated peer; ``ChannelError``, ``OSError`` and ``ValueError`` it raises
            end that connection only.
        name: the threads' name (the accepting one; peers get ``<name>-peer``).
        backlog: the listening socket's backlog.
        handshake_timeout_s: the deadline of one whole handshake.
    """

    def __init__(self, secret: str, bind_host: str, admit: Callable[[int, Role], bool], handle: Handler,
                 name: str, backlog: int = 128, handshake_timeout_s: float = handshake.HANDSHAKE_TIMEOUT_S) -> None:
        self._secret, self._admit, self._handle, self._name = secret, admit, handle, name
        self._timeout_s = handshake_timeout_s
        self._server = socket.create_server((bind_host, 0), backlog=backlog)
        self.port: int = self._server.getsockname()[1]
        self._pending = threading.BoundedSemaphore(MAX_PENDING_HANDSHAKES)
        self._conns: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._stopping = False
        self._accepter = threading.Thread(target=self._accept_loop, name=name, daemon=True)
        self._accepter.start()

    def close(self) -> None:
        """Stop accepting (the accepting thread ends) and close every authenticated connection.

        Closing a listening socket does not wake a thread blocked in ``accept()`` on Linux: the
        ``shutdown`` does (without it each server left that thread and its port behind for good).
        """
        with self._lock:
            self._stopping = True
            conns = list(self._conns)
        close_socket(self._server)
        if self._accepter is not threading.current_thread():
            self._accepter.join(timeout=ACCEPTER_JOIN_S)
        for conn in conns:
            close_socket(conn)

    def _accept_loop(self) -> None:
        while not self._stopping:
            try:
                conn, _ = self._server.accept()
            except OSError as e:
                if self._stopping:
                    return
                log.warning("%s could not accept a connection (retrying): %s", self._name, e)
                time.sleep(_ACCEPT_RETRY_S)
                continue
            self._admit_connection(conn)

    def _admit_connection(self, conn: socket.socket) -> None:
        """Hand a new connection to a thread of its own, or close it: never raises."""
        if not self._pending.acquire(blocking=False):
            close_socket(conn)
            return
        try:
            threading.Thread(target=self._serve, args=(conn,), name=f"{self._name}-peer", daemon=True).start()
        except Exception as e:  # a thread that cannot start must not end the accepting loop
            log.warning("%s could not serve a connection: %s", self._name, e)
            self._pending.release()
            close_socket(conn)

    def _serve(self, conn: socket.socket) -> None:
        try:
            try:
                who = handshake.serve(conn, self._secret, self._admit, self._timeout_s)
            finally:
                self._pending.release()
            if who is None or not self._track(conn):
                return
            conn.settimeout(None)
            self._handle(conn, who)
        except (ChannelError, OSError, ValueError) as e:
            log.debug("%s: a connection ended: %s", self._name, e)
        finally:
            with self._lock:
                self._conns.discard(conn)
            close_socket(conn)

    def _track(self, conn: socket.socket) -> bool:
        """Keep an authenticated connection for :meth:`close`; False once the server is closing."""
        with self._lock:
            if self._stopping:
                return False
            self._conns.add(conn)
            return True
