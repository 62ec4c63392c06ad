"""Length-prefixed frames on a stream socket.

A frame is ``kind`` (1 byte) + ``length`` (8 bytes, big-endian) + ``length`` bytes of body. The reader is
given a size limit per call, so an unauthenticated peer can never make the driver allocate more than a
few bytes, and an authenticated one no more than the job's frame limit.
"""

from __future__ import annotations

import socket
import struct
import threading
import time
from enum import IntEnum

from phalanx.errors import ChannelError

_HEADER = struct.Struct(">BQ")
#: Bytes of a frame's header (kind + body length).
HEADER_BYTES = _HEADER.size
_PIECE_BYTES = 1 << 20  # the most a body read takes from the socket at once
#: Largest frame an authenticated peer may send (a result of a few GiB is better saved to a file).
MAX_FRAME_BYTES = 4 << 30


class Kind(IntEnum):
    """Frame kinds. Driver -> worker: NONCE, PROOF, REFUSED, PAYLOAD, ABORT (and EVENT: a command to an
    elastic Spark task's supervisor). Worker -> driver: the others."""

    NONCE = 1
    AUTH = 2
    HELLO = 3
    PAYLOAD = 4
    LOG = 5
    RESULT = 6
    ERROR = 7
    ABORT = 8
    EVENT = 9
    PROOF = 10
    REFUSED = 11
    STATS = 12


def encode(kind: Kind, body: bytes = b"") -> bytes:
    """One whole frame as bytes (for a small body; :class:`FrameWriter` sends large ones in two writes)."""
    return _HEADER.pack(int(kind), len(body)) + body


def parse_header(header: bytes) -> tuple[int, int]:
    """A frame header's raw ``(kind, body length)`` (``header`` is :data:`HEADER_BYTES` long)."""
    kind, length = _HEADER.unpack(header)
    return int(kind), int(length)


def _recv(sock: socket.socket, n: int, deadline: float | None) -> bytes:
    """One ``recv``; with a deadline (``time.monotonic()`` seconds) the socket's timeout is what is left of it,
    so a peer that dribbles a byte at a time cannot stretch the wait past the deadline."""
    if deadline is not None:
        left = deadline - time.monotonic()
        if left <= 0:
            raise ChannelError("the peer did not finish its frame before the deadline")
        sock.settimeout(left)
    return sock.recv(n)


def _recv_exact(sock: socket.socket, n: int, deadline: float | None = None) -> bytes:
    chunks: list[bytes] = []
    remaining = n
    while remaining:
        chunk = _recv(sock, min(remaining, _PIECE_BYTES), deadline)
        if not chunk:
            raise ChannelError(f"connection closed with {remaining} of {n} bytes still expected")
        chunks.append(chunk)
        remaining -= len(chunk)
    return b"".join(chunks)


def read_frame(sock: socket.socket, limit: int = MAX_FRAME_BYTES,
               deadline: float | None = None) -> tuple[Kind, bytes] | None:
    """Read one frame.

    Args:
        sock: a connected stream socket.
        limit: the largest body accepted, in bytes.
        deadline: ``time.monotonic()`` by which the whole frame must have arrived (None: the socket's own
            timeout applies to each ``recv``).

    Returns:
        ``(kind, body)``, or None when the peer closed the connection cleanly between frames.

    Raises:
        ChannelError: unknown kind, body over ``limit``, a connection closed mid-frame, or the deadline
            passed.
        TimeoutError: the socket's own timeout expired (no deadline given).
    """
    head = read_header(sock, limit, deadline)
    if head is None:
        return None
    try:
        return head[0], _recv_exact(sock, head[1], deadline)
    except TimeoutError as e:
        if deadline is None:
            raise
        raise ChannelError("the peer did not finish its frame before the deadline") from e


def read_header(sock: socket.socket, limit: int = MAX_FRAME_BYTES,
                deadline: float | None = None) -> tuple[Kind, int] | None:
    """Read a frame's header: ``(kind, body length)``, or None when the peer closed cleanly between frames.
    The caller reads the body (:func:`read_frame` does both). Raises as :func:`read_frame`."""
    try:
        first = _recv(sock, 1, deadline)
        if not first:
            return None
        header = first + _recv_exact(sock, _HEADER.size - 1, deadline)
    except TimeoutError as e:
        if deadline is None:
            raise
        raise ChannelError("the peer did not finish its frame before the deadline") from e
    kind_raw, length = _HEADER.unpack(header)
    try:
        kind = Kind(kind_raw)
    except ValueError as e:
        raise ChannelError(f"unknown frame kind {kind_raw}") from e
    if length > limit:
        raise ChannelError(f"{kind.name} frame of {length} bytes is over the limit of {limit} bytes")
    return kind, length


class FrameWriter:
    """Writes whole frames to a socket; safe to share between threads."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self._lock = threading.Lock()

    def send(self, kind: Kind, body: bytes = b"") -> None:
        """Send one frame (header and body are never interleaved with another thread's frame)."""
        header = _HEADER.pack(int(kind), len(body))
        with self._lock:
            try:
                self._sock.sendall(header + body if len(body) < 65536 else header)
                if len(body) >= 65536:
                    self._sock.sendall(body)
            except OSError as e:
                raise ChannelError(f"could not send a {kind.name} frame: {e}") from e

    def close(self) -> None:
        """Close the underlying socket (unblocks a reader in another thread)."""
        close_socket(self._sock)


def close_socket(sock: socket.socket) -> None:
    """Shut a socket down both ways, then close it: a reader blocked on it in another thread wakes up."""
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    sock.close()
