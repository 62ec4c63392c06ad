"""A listening socket that serves a connection only once the peer proved it holds the job's secret.

The one server core of the driver's channel (:mod:`phalanx.job.channel`) and the job's store
(:mod:`phalanx.job.store`). One thread accepts and runs every handshake without blocking
(:mod:`phalanx.job.handshake`); only an authenticated peer gets a thread of its own, which sends the proof
and runs the owner's handler.

Anyone who can reach the port can open connections (another local user finds it in ``/proc/net/tcp``).
What an unauthenticated connection can cost the job is bounded:

- it holds a file descriptor and a few hundred bytes, no thread, for at most the pre-authentication
  deadline (:data:`phalanx.job.handshake.HANDSHAKE_TIMEOUT_S`, from accept to a whole ``AUTH`` frame;
  a real client answers in milliseconds);
- at most :data:`MAX_PENDING_HANDSHAKES` are pending at once, and at most :data:`MAX_PENDING_PER_SOURCE`
  from one source address; a new connection over either bound closes the oldest pending one (of its
  source, or of all), never the newest, so a stranger's idle connections cannot keep a real peer out: the
  peer is dropped only after that many newer arrivals, and it retries when it is.

The accepting thread survives any error but the server's own :meth:`AuthServer.close`.
"""

from __future__ import annotations

import errno
import logging
import resource
import selectors
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from phalanx.errors import ChannelError
from phalanx.job import handshake
from phalanx.job.framing import FrameWriter, Kind, close_socket, encode
from phalanx.job.handshake import Role

log = logging.getLogger(__name__)

#: Connections that may be in their handshake at once; a new one beyond closes the oldest.
MAX_PENDING_HANDSHAKES = 512
#: Of those, how many may come from one source address (a new one beyond closes that source's oldest).
MAX_PENDING_PER_SOURCE = 256
#: Open files the server asks for (the soft limit is raised up to the hard one) so that its pending
#: connections fit beside the process's own files.
WANTED_OPEN_FILES = 4096
ACCEPTER_JOIN_S = 5.0  # close() waits this long for the accepting thread to end (it is woken at once)
_ACCEPT_BATCH = 64  # accepts per wake-up before pending handshakes are read again
_ACCEPT_RETRY_S = 0.05  # pause after a failed accept (ENOBUFS, ...) before the next one
_OUT_OF_FILES = (errno.EMFILE, errno.ENFILE)

#: Serves one authenticated peer, (rank, role), until it returns; the connection is closed afterwards.
Handler = Callable[[socket.socket, tuple[int, Role]], None]


@dataclass(eq=False)
class _Pending:
    """A connection in its handshake: the nonce it was sent and the bytes it answered so far."""

    sock: socket.socket
    source: str
    nonce: bytes
    deadline: float
    received: bytearray = field(default_factory=bytearray)


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
        handshake_timeout_s: seconds from accept to a whole ``AUTH`` frame.
    """

    def __init__(self, secret: str, bind_host: str, admit: Callable[[int, Role], bool], handle: Handler,
                 name: str, backlog: int = 128, handshake_timeout_s: float = handshake.HANDSHAKE_TIMEOUT_S) -> None:
        self._secret, self._admit, self._handle, self._name = secret, admit, handle, name
        self._timeout_s = handshake_timeout_s
        _raise_open_files_limit()
        self._server = socket.create_server((bind_host, 0), backlog=backlog)
        self._server.setblocking(False)
        self.port: int = self._server.getsockname()[1]
        self._pending: dict[socket.socket, _Pending] = {}  # oldest first
        self._by_source: dict[str, dict[socket.socket, _Pending]] = {}
        self._wake_r, self._wake_w = socket.socketpair()
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._server, selectors.EVENT_READ, None)
        self._selector.register(self._wake_r, selectors.EVENT_READ, self._wake_r)
        self._conns: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._stopping = False
        self._accepter = threading.Thread(target=self._loop, name=name, daemon=True)
        self._accepter.start()

    def close(self) -> None:
        """Stop accepting (the accepting thread ends), close every pending and authenticated connection."""
        with self._lock:
            self._stopping = True
            conns = list(self._conns)
        try:
            self._wake_w.send(b"x")
        except OSError:
            pass
        if self._accepter is not threading.current_thread():
            self._accepter.join(timeout=ACCEPTER_JOIN_S)
        for conn in conns:
            close_socket(conn)

    def _loop(self) -> None:
        try:
            while not self._stopping:
                try:
                    self._step()
                except Exception as e:  # the accepting thread must outlive any one connection's failure
                    log.warning("%s: %s", self._name, e)
                    time.sleep(_ACCEPT_RETRY_S)
        finally:
            for pending in list(self._pending.values()):
                self._drop(pending)
            self._selector.close()
            for sock in (self._server, self._wake_r, self._wake_w):
                close_socket(sock)

    def _step(self) -> None:
        """Wait for the next arrival, answer or deadline; handle what is ready."""
        first = next(iter(self._pending.values()), None)  # the oldest has the earliest deadline
        timeout = None if first is None else max(0.0, first.deadline - time.monotonic())
        for key, _ in self._selector.select(timeout):
            if key.data is None:
                self._accept_batch()
            elif isinstance(key.data, _Pending):
                self._read(key.data)
        now = time.monotonic()
        while self._pending:
            oldest = next(iter(self._pending.values()))
            if oldest.deadline > now:
                break
            self._drop(oldest)

    def _accept_batch(self) -> None:
        for _ in range(_ACCEPT_BATCH):
            try:
                conn, addr = self._server.accept()
            except BlockingIOError:
                return
            except OSError as e:
                if e.errno in _OUT_OF_FILES and self._pending:  # a stranger's connection frees a descriptor
                    self._drop(next(iter(self._pending.values())))
                    continue
                if not self._stopping:
                    log.warning("%s could not accept a connection (retrying): %s", self._name, e)
                    time.sleep(_ACCEPT_RETRY_S)
                return
            self._challenge(conn, str(addr[0]))

    def _challenge(self, conn: socket.socket, source: str) -> None:
        """Make room for a new connection (closing the oldest pending ones), then send it the challenge."""
        mine = self._by_source.get(source, {})
        if len(mine) >= MAX_PENDING_PER_SOURCE:
            self._drop(next(iter(mine.values())))
        elif len(self._pending) >= MAX_PENDING_HANDSHAKES:
            self._drop(next(iter(self._pending.values())))
        conn.setblocking(False)
        nonce, frame = handshake.challenge()
        try:
            sent = conn.send(frame)  # a fresh connection's send buffer always has room for one frame
        except OSError:
            sent = -1
        if sent != len(frame):
            close_socket(conn)
            return
        pending = _Pending(conn, source, nonce, time.monotonic() + self._timeout_s)
        self._pending[conn] = pending
        self._by_source.setdefault(source, {})[conn] = pending
        self._selector.register(conn, selectors.EVENT_READ, pending)

    def _read(self, pending: _Pending) -> None:
        try:
            data = pending.sock.recv(handshake.AUTH_FRAME_BYTES - len(pending.received))
        except BlockingIOError:
            return
        except OSError:
            data = b""
        pending.received += data
        if not data or not handshake.auth_prefix_ok(bytes(pending.received)):
            self._drop(pending)
        elif len(pending.received) == handshake.AUTH_FRAME_BYTES:
            self._forget(pending)
            self._verify(pending)

    def _verify(self, pending: _Pending) -> None:
        """Start an authenticated peer's thread, or tell a refused one so and close it."""
        verdict = handshake.verify(pending.nonce, bytes(pending.received), self._secret, self._admit)
        conn = pending.sock
        if verdict is None:
            try:
                conn.send(encode(Kind.REFUSED))
            except OSError:
                pass
            close_socket(conn)
            return
        try:
            threading.Thread(target=self._serve, args=(conn, *verdict), name=f"{self._name}-peer",
                             daemon=True).start()
        except Exception as e:  # a thread that cannot start must not end the accepting loop
            log.warning("%s could not serve a connection: %s", self._name, e)
            close_socket(conn)  # the peer sees no proof and retries

    def _forget(self, pending: _Pending) -> None:
        """Stop tracking a pending connection (it is now the caller's)."""
        self._selector.unregister(pending.sock)
        del self._pending[pending.sock]
        mine = self._by_source[pending.source]
        del mine[pending.sock]
        if not mine:
            del self._by_source[pending.source]

    def _drop(self, pending: _Pending) -> None:
        self._forget(pending)
        close_socket(pending.sock)

    def _serve(self, conn: socket.socket, who: tuple[int, Role], proof: bytes) -> None:
        try:
            conn.setblocking(True)
            if not self._track(conn):
                return
            FrameWriter(conn).send(Kind.PROOF, proof)
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


def _raise_open_files_limit() -> None:
    """Raise this process's soft limit on open files towards :data:`WANTED_OPEN_FILES` (never above the
    hard limit, never lower): strangers' pending connections must not exhaust the job's descriptors."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = WANTED_OPEN_FILES if hard == resource.RLIM_INFINITY else min(WANTED_OPEN_FILES, hard)
    if soft != resource.RLIM_INFINITY and soft < want:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
        except (ValueError, OSError) as e:
            log.debug("could not raise the open files limit to %d: %s", want, e)
