"""A listening socket that serves a connection only once the peer proved it holds the job's secret.

The one server core of the driver's channel (:mod:`phalanx.job.channel`) and the job's store
(:mod:`phalanx.job.store`). One thread (the server's loop) accepts, runs every handshake without blocking
(:mod:`phalanx.job.handshake`), and reads every authenticated connection: its bytes are cut into frames
(:mod:`phalanx.job.frame_stream`) and handed to the connection's session, which the owner made for it. A
thousand ranks cost one thread, not a thousand, and one ``recv`` takes as many frames as have arrived. An
authenticated peer gets a short-lived thread of its own only for its greeting: the proof and whatever the
owner sends first (the channel's payload may be large, and a slow reader must not hold the loop).
The loop also runs the owner's timers and calls handed to it from other threads (:meth:`AuthServer.call_at`,
:meth:`AuthServer.call_soon`), so a session's state is only ever touched by the loop.

Anyone who can reach the port can open connections (another local user finds it in ``/proc/net/tcp``).
What an unauthenticated connection can cost the job is bounded:

- it holds a file descriptor and a few hundred bytes, no thread, for at most the pre-authentication
  deadline (:data:`phalanx.job.handshake.HANDSHAKE_TIMEOUT_S`, from accept to a whole ``AUTH`` frame;
  a real client answers in milliseconds);
- at most :data:`MAX_PENDING_HANDSHAKES` are pending at once, and at most :data:`MAX_PENDING_PER_SOURCE`
  from one source address; a new connection over either bound closes the oldest pending one (of its
  source, or of all), never the newest, so a stranger's idle connections cannot keep a real peer out: the
  peer is dropped only after that many newer arrivals, and it retries when it is.

The loop survives any error but the server's own :meth:`AuthServer.close`; a session that raises loses its
connection only.
"""

from __future__ import annotations

import errno
import heapq
import itertools
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
from phalanx.job.frame_stream import FrameParser, Session
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
ACCEPTER_JOIN_S = 5.0  # close() waits this long for the loop to end (it is woken at once)
_ACCEPT_BATCH = 64  # accepts per wake-up before pending handshakes are read again
_ACCEPT_RETRY_S = 0.05  # pause after a failed accept (ENOBUFS, ...) before the next one
_RECV_BYTES = 256 << 10  # the most one read of an authenticated connection takes
_TIMERS_COMPACT = 1024  # every this many timers, cancelled ones are swept out of the heap
_OUT_OF_FILES = (errno.EMFILE, errno.ENFILE)
_EXPECTED = (ChannelError, OSError, ValueError)  # a peer's protocol errors: its connection ends, quietly

#: Makes the session of one authenticated peer, (rank, role), on the peer's greeting thread, after the proof
#: was sent (it may send the peer more first); None: the peer is not served (its connection is closed).
Opener = Callable[[socket.socket, tuple[int, Role]], Session | None]


@dataclass(eq=False)
class _Pending:
    """A connection in its handshake: the nonce it was sent and the bytes it answered so far."""

    sock: socket.socket
    source: str
    nonce: bytes
    deadline: float
    received: bytearray = field(default_factory=bytearray)


@dataclass(eq=False)
class _Peer:
    """An authenticated connection the loop reads."""

    sock: socket.socket
    session: Session
    parser: FrameParser


@dataclass(order=True)
class Timer:
    """A call the loop makes at ``when`` (``time.monotonic()``) unless cancelled first."""

    when: float
    seq: int
    fn: Callable[[], None] = field(compare=False)
    cancelled: bool = field(default=False, compare=False)

    def cancel(self) -> None:
        """Do not make the call (a no-op once it was made)."""
        self.cancelled = True


class AuthServer:
    """Listens on ``bind_host`` (a free port, bound on construction) and serves each authenticated
    connection through the session ``opener`` makes for it. Accepting starts at once: build it last.

    Args:
        secret: the job's secret (hex).
        bind_host: address to listen on.
        admit: whether a (rank, role) may connect at all (checked before its proof).
        opener: makes an authenticated peer's session (:data:`Opener`); ``ChannelError``, ``OSError`` and
            ``ValueError`` it raises end that connection only.
        name: the loop thread's name (greeting threads get ``<name>-greet``).
        backlog: the listening socket's backlog.
        handshake_timeout_s: seconds from accept to a whole ``AUTH`` frame.
    """

    def __init__(self, secret: str, bind_host: str, admit: Callable[[int, Role], bool], opener: Opener,
                 name: str, backlog: int = 128, handshake_timeout_s: float = handshake.HANDSHAKE_TIMEOUT_S) -> None:
        self._secret, self._admit, self._open, self._name = secret, admit, opener, name
        self._timeout_s = handshake_timeout_s
        _raise_open_files_limit()
        self._server = socket.create_server((bind_host, 0), backlog=backlog)
        self._server.setblocking(False)
        self.port: int = self._server.getsockname()[1]
        self._pending: dict[socket.socket, _Pending] = {}  # oldest first
        self._by_source: dict[str, dict[socket.socket, _Pending]] = {}
        self._peers: dict[socket.socket, _Peer] = {}
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._server, selectors.EVENT_READ, None)
        self._selector.register(self._wake_r, selectors.EVENT_READ, self._wake_r)
        self._lock = threading.Lock()  # guards what other threads hand the loop: _adopted, _timers
        self._adopted: list[_Peer] = []
        self._timers: list[Timer] = []
        self._seq = itertools.count()
        self._stopping = False
        self._accepter = threading.Thread(target=self._loop, name=name, daemon=True)
        self._accepter.start()

    def close(self) -> None:
        """Stop the loop (it ends at once), close every pending and authenticated connection; each session
        is told its connection ended."""
        with self._lock:
            self._stopping = True
        self._wake()
        if self._accepter is not threading.current_thread():
            self._accepter.join(timeout=ACCEPTER_JOIN_S)
        if self._accepter.is_alive():  # held by a session: its peers at least see the end
            for peer in list(self._peers.values()):
                _shut(peer.sock)

    def call_at(self, when: float, fn: Callable[[], None]) -> Timer:
        """Have the loop call ``fn`` at ``when`` (``time.monotonic()``) or soon after; from any thread."""
        timer = Timer(when, next(self._seq), fn)
        with self._lock:
            if timer.seq % _TIMERS_COMPACT == 0 and len(self._timers) >= _TIMERS_COMPACT:
                self._timers = [t for t in self._timers if not t.cancelled]  # cancelled far-off waits
                heapq.heapify(self._timers)
            heapq.heappush(self._timers, timer)
            first = self._timers[0] is timer
        if first and threading.current_thread() is not self._accepter:
            self._wake()
        return timer

    def call_soon(self, fn: Callable[[], None]) -> Timer:
        """Have the loop call ``fn`` as soon as it can; from any thread."""
        return self.call_at(0.0, fn)

    def _wake(self) -> None:
        try:
            self._wake_w.send(b"x")
        except OSError:  # full (the loop is awake anyway) or closed
            pass

    def _loop(self) -> None:
        try:
            while not self._stopping:
                try:
                    self._step()
                except Exception as e:  # the loop must outlive any one connection's failure
                    log.warning("%s: %s", self._name, e)
                    time.sleep(_ACCEPT_RETRY_S)
        finally:
            self._shutdown()

    def _shutdown(self) -> None:
        for pending in list(self._pending.values()):
            self._drop(pending)
        for peer in list(self._peers.values()):
            self._end(peer, None)
        with self._lock:
            adopted, self._adopted = self._adopted, []
        for peer in adopted:
            _finish(peer, None)
        self._selector.close()
        for sock in (self._server, self._wake_r, self._wake_w):
            close_socket(sock)

    def _step(self) -> None:
        """Wait for the next arrival, answer, frame, timer or deadline; handle what is ready."""
        for key, _ in self._selector.select(self._next_wait()):
            data = key.data
            if data is None:
                self._accept_batch()
            elif isinstance(data, _Peer):
                self._read_peer(data)
            elif isinstance(data, _Pending):
                self._read(data)
            else:
                self._woken()
        self._run_timers()
        now = time.monotonic()
        while self._pending:
            oldest = next(iter(self._pending.values()))
            if oldest.deadline > now:
                break
            self._drop(oldest)

    def _next_wait(self) -> float | None:
        """Seconds until the earliest handshake deadline or timer (None: nothing is due)."""
        first = next(iter(self._pending.values()), None)  # the oldest has the earliest deadline
        due = [first.deadline] if first is not None else []
        with self._lock:
            if self._timers:
                due.append(self._timers[0].when)
        return max(0.0, min(due) - time.monotonic()) if due else None

    def _woken(self) -> None:
        try:
            while self._wake_r.recv(4096):
                pass
        except BlockingIOError:
            pass
        with self._lock:
            adopted, self._adopted = self._adopted, []
        for peer in adopted:
            self._peers[peer.sock] = peer
            self._selector.register(peer.sock, selectors.EVENT_READ, peer)

    def _run_timers(self) -> None:
        now = time.monotonic()
        while True:
            with self._lock:
                if not self._timers or self._timers[0].when > now:
                    return
                timer = heapq.heappop(self._timers)
            if timer.cancelled:
                continue
            try:
                timer.fn()
            except Exception as e:  # one owner's call must not end the loop
                log.warning("%s: a scheduled call failed: %s", self._name, e)

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
        """Start an authenticated peer's greeting, or tell a refused one so and close it."""
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
            threading.Thread(target=self._greet, args=(conn, *verdict), name=f"{self._name}-greet",
                             daemon=True).start()
        except Exception as e:  # a thread that cannot start must not end the loop
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

    def _greet(self, conn: socket.socket, who: tuple[int, Role], proof: bytes) -> None:
        """On the peer's own thread: send the proof, let the owner open the session (and send its first
        frames), then hand the connection to the loop."""
        session: Session | None = None
        try:
            conn.setblocking(True)
            if self._stopping:
                close_socket(conn)
                return
            FrameWriter(conn).send(Kind.PROOF, proof)
            session = self._open(conn, who)
        except _EXPECTED as e:
            log.debug("%s: a connection ended in its greeting: %s", self._name, e)
        if session is None:
            close_socket(conn)
            return
        peer = _Peer(conn, session, FrameParser(session))
        with self._lock:
            adopted = not self._stopping
            if adopted:
                self._adopted.append(peer)
        if adopted:
            self._wake()
        else:  # the server closed meanwhile
            _finish(peer, None)

    def _read_peer(self, peer: _Peer) -> None:
        """Read what an authenticated peer sent; its session gets every whole frame."""
        try:
            data = peer.sock.recv(_RECV_BYTES, socket.MSG_DONTWAIT)
        except BlockingIOError:
            return
        except OSError as e:
            self._end(peer, e)
            return
        if not data:
            self._end(peer, None)
            return
        try:
            peer.parser.feed(data)
        except _EXPECTED as e:
            log.debug("%s: a connection ended: %s", self._name, e)
            self._end(peer, e)
        except Exception as e:  # a session's own failure ends its connection, never the loop
            log.warning("%s: a connection ended: %s: %s", self._name, type(e).__name__, e)
            self._end(peer, e)

    def _end(self, peer: _Peer, error: BaseException | None) -> None:
        self._selector.unregister(peer.sock)
        del self._peers[peer.sock]
        _finish(peer, error)


def _finish(peer: _Peer, error: BaseException | None) -> None:
    """Close an authenticated connection and tell its session."""
    close_socket(peer.sock)
    try:
        peer.session.ended(error)
    except Exception as e:
        log.warning("a session's end failed: %s: %s", type(e).__name__, e)


def _shut(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass


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
