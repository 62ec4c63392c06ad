"""The authenticated channel between the driver and the job's workers.

The driver listens; each worker (or the supervisor that forwards a worker's logs) connects, and both sides
prove they hold the per-job secret (:mod:`phalanx.job.handshake`: a challenge each way, one deadline for
the whole exchange). A peer that fails, sends garbage or is too slow is closed and leaves no trace: no
event reaches the job; a worker reads nothing from a server that could not prove itself. Afterwards the
driver sends the payload and the peer streams hellos, log lines, its result or its error.

Accepting, the handshake and its bounds are :class:`phalanx.job.auth_server.AuthServer`'s (the store's
too): strangers' idle connections cost a descriptor each for at most the pre-authentication deadline, the
oldest are closed when too many are pending, and a worker dropped that way retries until its start
timeout. The server's one loop thread reads every peer and turns its frames into events (:class:`_Peer`):
when the driver reads events slower than the ranks write, the loop waits in :meth:`EventQueue.put`, the
peers' sockets fill and the ranks block on their next write; no line is dropped.
"""

from __future__ import annotations

import select
import socket
import threading
import time
from dataclasses import dataclass

from phalanx.errors import ChannelError
from phalanx.job import handshake
from phalanx.job.auth_server import AuthServer
from phalanx.job.events import EventQueue
from phalanx.job.frame_stream import BodySink
from phalanx.job.framing import MAX_FRAME_BYTES, FrameWriter, Kind, close_socket, read_frame
from phalanx.job.handshake import Role, new_secret
from phalanx.job.records import ErrorRecord, Hello, LogLine
from phalanx.job.spool import SPOOL_BYTES, Spooled, SpoolError, SpoolWriter
from phalanx.job.stats import RankStats

__all__ = ["Closed", "Custom", "DriverChannel", "Event", "Result", "Role", "WorkerChannel", "new_secret"]

#: Seconds an unauthenticated peer has for the whole handshake.
AUTH_TIMEOUT_S = handshake.HANDSHAKE_TIMEOUT_S


@dataclass(frozen=True)
class Result:
    """A rank's serialized return value (a large one in a file: :mod:`phalanx.job.spool`)."""

    rank: int
    value: bytes | Spooled


@dataclass(frozen=True)
class Closed:
    """An authenticated connection ended."""

    rank: int
    role: Role


@dataclass(frozen=True)
class Custom:
    """A free-form event (for launchers built on the channel, e.g. Spark status)."""

    rank: int
    body: bytes


#: The peer closed its end, or the connection broke (``POLLHUP`` and ``POLLERR`` are always reported).
_PEER_CLOSED = select.POLLRDHUP | select.POLLHUP | select.POLLERR

Event = Hello | LogLine | Result | ErrorRecord | Closed | Custom | RankStats


class DriverChannel:
    """The driver's end: accepts authenticated workers and turns their frames into events.

    Args:
        world_size: number of ranks; a peer claiming another rank is refused.
        payload: bytes sent to every authenticated peer (the serialized job; may be empty).
        bind_host: address to listen on; loopback for local jobs.
        advertise_host: address workers connect to (defaults to ``bind_host``).
    """

    def __init__(self, world_size: int, payload: bytes, bind_host: str = "127.0.0.1",
                 advertise_host: str | None = None) -> None:
        self.world_size = world_size
        self.secret = new_secret()
        self.events = EventQueue()
        self._payload = payload
        self._advertise = advertise_host or bind_host
        self._lock = threading.Lock()
        self._peers: dict[tuple[int, Role], FrameWriter] = {}
        self._closed = {r: threading.Event() for r in range(world_size)}
        self._closed_at: dict[tuple[int, Role], float] = {}
        self._hosts: dict[int, str] = {}
        self._seen: set[int] = set()
        self._conns: dict[tuple[int, Role], socket.socket] = {}
        self._stopping = False
        self._server = AuthServer(self.secret, bind_host, self._admits, self._open, name="phalanx-channel",
                                  backlog=max(128, 2 * world_size), handshake_timeout_s=AUTH_TIMEOUT_S)

    @property
    def address(self) -> str:
        """``host:port`` that workers connect to."""
        return f"{self._advertise}:{self._server.port}"

    def worker_done(self, rank: int, timeout_s: float) -> bool:
        """Wait until rank's worker connection has closed; False if it did not within ``timeout_s``."""
        return self._closed[rank].wait(timeout_s)

    def is_connected(self, rank: int) -> bool:
        """True once rank's worker process has authenticated."""
        with self._lock:
            return (rank, Role.WORKER) in self._peers or self._closed[rank].is_set()

    def ever_connected(self, rank: int) -> bool:
        """True once any peer (the rank's process or its supervisor) authenticated for ``rank``."""
        with self._lock:
            return rank in self._seen

    def abort_all(self) -> None:
        """Ask every connected peer to stop now (best effort; the launcher still kills processes)."""
        with self._lock:
            writers = list(self._peers.values())
        for writer in writers:
            try:
                writer.send(Kind.ABORT)
            except ChannelError:
                pass

    def command(self, rank: int, role: Role, body: bytes) -> bool:
        """Send an EVENT frame (a command) to one peer; False when it is not connected (or went away)."""
        with self._lock:
            writer = self._peers.get((rank, role))
        if writer is None:
            return False
        try:
            writer.send(Kind.EVENT, body)
        except ChannelError:
            return False
        return True

    def close(self) -> None:
        """Stop accepting (the accepting thread ends) and close every connection."""
        with self._lock:
            self._stopping = True
        self.events.close()
        self._server.close()

    def _admits(self, rank: int, role: Role) -> bool:
        return rank < self.world_size and role in (Role.WORKER, Role.SUPERVISOR)

    def _open(self, conn: socket.socket, who: tuple[int, Role]) -> _Peer | None:
        """Register an authenticated peer and send it the payload (on its greeting thread); None: refused
        (its rank and role are connected already, or the channel is closing)."""
        writer = FrameWriter(conn)
        with self._lock:
            if who in self._peers or self._stopping:
                return None
            self._peers[who] = writer
            self._seen.add(who[0])
            self._conns[who] = conn
            self._closed_at.pop(who, None)
        try:
            writer.send(Kind.PAYLOAD, self._payload)
        except BaseException:
            self._unregister(who)
            raise
        return _Peer(self, who)

    def closed_at(self, rank: int, role: Role) -> float | None:
        """``time.monotonic()`` when an authenticated peer's connection ended (None: still open, or never)."""
        with self._lock:
            return self._closed_at.get((rank, role))

    def host_of(self, rank: int) -> str | None:
        """The host a rank's worker said it runs on (its hello), or None before that."""
        with self._lock:
            return self._hosts.get(rank)

    def _unregister(self, who: tuple[int, Role]) -> None:
        with self._lock:
            self._peers.pop(who, None)
            self._conns.pop(who, None)
            self._closed_at.setdefault(who, time.monotonic())  # _note_closed may have seen it end first
        self.events.put(Closed(rank=who[0], role=who[1]))
        if who[1] is Role.WORKER:
            self._closed[who[0]].set()

    def _note_closed(self, sender: int) -> None:
        """Stamp every connection its peer has already closed (its end waits unread) with now, but the
        ``sender``'s: it was alive to send the error, and its own end after it must not tie with a dead
        rank's (a tie would put the lower rank first).

        Called before an error is queued: a rank whose process died before a survivor's error arrived is
        then known to have died first, however late the server's loop reads its end (a survivor's error
        about a lost peer used to win that race on a loaded driver). The peer's close is asked of the kernel
        (``POLLRDHUP``: its FIN arrived), not read, so frames it sent before dying and still unread (its
        hello, under load) do not hide it.
        """
        now = time.monotonic()
        with self._lock:
            conns = list(self._conns.items())
        poller = select.poll()
        by_fd: dict[int, tuple[int, Role]] = {}
        ended: list[tuple[int, Role]] = []
        for who, conn in conns:
            if who[0] == sender:
                continue
            fd = conn.fileno()
            if fd < 0:  # closed here meanwhile
                ended.append(who)
                continue
            by_fd[fd] = who
            poller.register(fd, _PEER_CLOSED)
        ended += [by_fd[fd] for fd, happened in poller.poll(0) if happened & _PEER_CLOSED and fd in by_fd]
        if ended:
            with self._lock:
                for who in ended:
                    self._closed_at.setdefault(who, now)

    def _received(self, rank: int, event: Event) -> None:
        """Queue an event from ``rank``'s peer (on the server's loop)."""
        if isinstance(event, Hello):
            with self._lock:
                self._hosts[rank] = event.host
        elif isinstance(event, ErrorRecord):
            self._note_closed(rank)
        self.events.put(event)


class _Peer:
    """One authenticated peer's frames turned into events (a :class:`phalanx.job.frame_stream.Session`);
    a result over :data:`SPOOL_BYTES` goes to a file as it arrives."""

    limit = MAX_FRAME_BYTES

    def __init__(self, channel: DriverChannel, who: tuple[int, Role]) -> None:
        self._channel, self._who = channel, who
        self._spool: SpoolWriter | None = None

    def sink(self, kind: Kind, length: int) -> BodySink | None:
        if kind is not Kind.RESULT or length <= SPOOL_BYTES:
            return None
        self._spool = SpoolWriter(length)
        return self._spool

    def frame(self, kind: Kind, body: bytes | BodySink) -> None:
        rank = self._who[0]
        if isinstance(body, SpoolWriter):
            self._spool = None
            event: Event | None = Result(rank=rank, value=body.finish())
        else:
            assert isinstance(body, bytes)
            event = _decode(rank, kind, body)
        if event is not None:
            self._channel._received(rank, event)

    def ended(self, error: BaseException | None) -> None:
        if self._spool is not None:
            self._spool.discard()
        if isinstance(error, SpoolError):  # the rank's failure, with the driver's disk named as its cause
            self._channel.events.put(ErrorRecord(rank=self._who[0], exc_type="OSError", message=str(error),
                                                 traceback=""))
        self._channel._unregister(self._who)


def _decode(rank: int, kind: Kind, body: bytes) -> Event | None:
    """Turn a frame from an authenticated peer into an event; frames naming another rank are dropped."""
    event: Event
    if kind is Kind.HELLO:
        event = Hello.decode(body)
    elif kind is Kind.LOG:
        event = LogLine.decode(body)
    elif kind is Kind.RESULT:
        event = Result(rank=rank, value=body)
    elif kind is Kind.ERROR:
        event = ErrorRecord.decode(body)
    elif kind is Kind.EVENT:
        event = Custom(rank=rank, body=body)
    elif kind is Kind.STATS:
        try:
            event = RankStats.decode(body)
        except (ValueError, KeyError, TypeError, IndexError):  # malformed: dropped, the job is not judged by it
            return None
    else:
        raise ChannelError(f"a worker may not send {kind.name} frames")
    if getattr(event, "rank", rank) != rank:
        return None
    return event


class WorkerChannel:
    """A worker's (or supervisor's) end of the channel."""

    def __init__(self, sock: socket.socket, payload: bytes) -> None:
        self._sock = sock
        self._writer = FrameWriter(sock)
        self.payload = payload

    @classmethod
    def connect(cls, address: str, secret: str, rank: int, role: Role, timeout_s: float) -> WorkerChannel:
        """Connect, authenticate both ways and receive the payload, within ``timeout_s`` in all.

        A driver that is busy (it closed the connection before its proof) or not yet reachable is retried
        until the timeout.

        Raises:
            ChannelError: the driver is unreachable, refused the secret, could not prove it holds the
                secret, or did not answer in time.
        """
        deadline = time.monotonic() + timeout_s
        host, _, port = address.rpartition(":")
        sock = handshake.dial(host, int(port), secret, rank, role, deadline, "the driver's channel")
        try:
            payload = read_frame(sock, deadline=deadline)
        except BaseException:
            close_socket(sock)
            raise
        if payload is None or payload[0] is not Kind.PAYLOAD:
            close_socket(sock)
            raise ChannelError(f"the driver at {address} refused rank {rank} (already connected?)")
        sock.settimeout(None)
        return cls(sock, payload[1])

    def send(self, kind: Kind, body: bytes = b"") -> None:
        """Send one frame to the driver."""
        self._writer.send(kind, body)

    def wait_for_abort(self) -> None:
        """Block until the driver sends ABORT or goes away (for a watchdog thread)."""
        try:
            while True:
                frame = read_frame(self._sock, limit=1 << 10)
                if frame is None or frame[0] is Kind.ABORT:
                    return
        except (ChannelError, OSError):
            return

    def next_command(self) -> bytes | None:
        """Block until the driver sends a command (an EVENT frame; returned) or ABORT / goes away (None)."""
        try:
            while True:
                frame = read_frame(self._sock, limit=1 << 10)
                if frame is None or frame[0] is Kind.ABORT:
                    return None
                if frame[0] is Kind.EVENT:
                    return frame[1]
        except (ChannelError, OSError):
            return None

    def close(self) -> None:
        """Close the connection (the driver sees the rank's channel close)."""
        close_socket(self._sock)
