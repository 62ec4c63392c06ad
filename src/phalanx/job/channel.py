"""The authenticated channel between the driver and the job's workers.

The driver listens; each worker (or the supervisor that forwards a worker's logs) connects and proves it
holds the per-job secret: the driver sends a random nonce, the peer answers
``HMAC-SHA256(secret, nonce + rank + role)``, compared in constant time. A peer that fails, sends garbage
or is too slow is closed and leaves no trace: no event reaches the job. Afterwards the driver sends the
payload and the peer streams hellos, log lines, its result or its error.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import queue
import secrets
import socket
import struct
import threading
from dataclasses import dataclass
from enum import IntEnum

from phalanx.errors import ChannelError
from phalanx.job.framing import FrameWriter, Kind, close_socket, read_frame
from phalanx.job.records import ErrorRecord, Hello, LogLine

_AUTH = struct.Struct(">IB32s")
_NONCE_BYTES = 32
#: Seconds an unauthenticated peer has to answer the nonce.
AUTH_TIMEOUT_S = 10.0
ACCEPTER_JOIN_S = 5.0  # close() waits this long for the accepting thread to end (it is woken at once)


class Role(IntEnum):
    """What an authenticated peer is: the rank's own process, or a supervisor forwarding its output."""

    WORKER = 0
    SUPERVISOR = 1


def new_secret() -> str:
    """A fresh per-job secret (hex)."""
    return secrets.token_hex(32)


def _mac(secret: str, nonce: bytes, rank: int, role: Role) -> bytes:
    msg = nonce + struct.pack(">IB", rank, int(role))
    return hmac.new(bytes.fromhex(secret), msg, hashlib.sha256).digest()


@dataclass(frozen=True)
class Result:
    """A rank's serialized return value."""

    rank: int
    value: bytes


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


Event = Hello | LogLine | Result | ErrorRecord | Closed | Custom


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
        self.events: queue.Queue[Event] = queue.Queue()
        self._payload = payload
        self._server = socket.create_server((bind_host, 0), backlog=max(128, 2 * world_size))
        self._advertise = advertise_host or bind_host
        self._lock = threading.Lock()
        self._peers: dict[tuple[int, Role], FrameWriter] = {}
        self._closed = {r: threading.Event() for r in range(world_size)}
        self._stopping = False
        self._accepter = threading.Thread(target=self._accept_loop, name="phalanx-channel", daemon=True)
        self._accepter.start()

    @property
    def address(self) -> str:
        """``host:port`` that workers connect to."""
        return f"{self._advertise}:{self._server.getsockname()[1]}"

    def worker_done(self, rank: int, timeout_s: float) -> bool:
        """Wait until rank's worker connection has closed; False if it did not within ``timeout_s``."""
        return self._closed[rank].wait(timeout_s)

    def is_connected(self, rank: int) -> bool:
        """True once rank's worker process has authenticated."""
        with self._lock:
            return (rank, Role.WORKER) in self._peers or self._closed[rank].is_set()

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
        """Stop accepting (the accepting thread ends) and close every connection.

        Closing a listening socket does not wake a thread blocked in ``accept()`` on Linux: without the
        ``shutdown`` every job left that thread and its listening port behind in the driver for good.
        """
        self._stopping = True
        try:
            self._server.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        try:
            self._server.close()
        except OSError:
            pass
        if self._accepter is not threading.current_thread():
            self._accepter.join(timeout=ACCEPTER_JOIN_S)
        with self._lock:
            writers = list(self._peers.values())
        for writer in writers:
            writer.close()

    def _accept_loop(self) -> None:
        while not self._stopping:
            try:
                conn, _ = self._server.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), name="phalanx-peer", daemon=True).start()

    def _authenticate(self, conn: socket.socket) -> tuple[int, Role] | None:
        nonce = os.urandom(_NONCE_BYTES)
        conn.settimeout(AUTH_TIMEOUT_S)
        FrameWriter(conn).send(Kind.NONCE, nonce)
        frame = read_frame(conn, limit=_AUTH.size)
        if frame is None or frame[0] is not Kind.AUTH or len(frame[1]) != _AUTH.size:
            return None
        rank, role_raw, mac = _AUTH.unpack(frame[1])
        if rank >= self.world_size or role_raw not in (0, 1):
            return None
        role = Role(role_raw)
        if not hmac.compare_digest(mac, _mac(self.secret, nonce, rank, role)):
            return None
        return rank, role

    def _serve(self, conn: socket.socket) -> None:
        who: tuple[int, Role] | None = None
        try:
            who = self._authenticate(conn)
            if who is None or not self._register(who, conn):
                who = None
                return
            conn.settimeout(None)
            self._peers[who].send(Kind.PAYLOAD, self._payload)
            self._pump(conn, who[0])
        except (ChannelError, OSError, ValueError):
            pass
        finally:
            conn.close()
            if who is not None:
                self._unregister(who)

    def _register(self, who: tuple[int, Role], conn: socket.socket) -> bool:
        with self._lock:
            if who in self._peers or self._stopping:
                return False
            self._peers[who] = FrameWriter(conn)
            return True

    def _unregister(self, who: tuple[int, Role]) -> None:
        with self._lock:
            self._peers.pop(who, None)
        self.events.put(Closed(rank=who[0], role=who[1]))
        if who[1] is Role.WORKER:
            self._closed[who[0]].set()

    def _pump(self, conn: socket.socket, rank: int) -> None:
        while True:
            frame = read_frame(conn)
            if frame is None:
                return
            event = _decode(rank, *frame)
            if event is not None:
                self.events.put(event)


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
        """Connect, authenticate and receive the payload.

        Raises:
            ChannelError: the driver is unreachable, refused the secret, or did not answer in time.
        """
        host, _, port = address.rpartition(":")
        try:
            sock = socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s)
            nonce = read_frame(sock, limit=_NONCE_BYTES)
            if nonce is None or nonce[0] is not Kind.NONCE:
                raise ChannelError(f"the driver at {address} did not send a nonce")
            FrameWriter(sock).send(Kind.AUTH, _AUTH.pack(rank, int(role), _mac(secret, nonce[1], rank, role)))
            payload = read_frame(sock)
        except OSError as e:
            raise ChannelError(f"rank {rank} could not reach the driver's channel at {address}: {e}") from e
        if payload is None or payload[0] is not Kind.PAYLOAD:
            raise ChannelError(f"the driver at {address} refused rank {rank} (wrong job secret?)")
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
