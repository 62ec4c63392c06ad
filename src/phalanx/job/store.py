"""The job's key-value store (torch.distributed's rendezvous store), behind the channel's handshake.

torch's ``TCPStore`` answers anyone who can reach its port: another local user could rewrite the keys a
job meets by. phalanx's store speaks a protocol of its own after :mod:`phalanx.job.handshake` (role
``STORE``), so only a holder of the job's secret reads or writes a key. Ranks use it through
:class:`phalanx.job.store_client.StoreClient`, a ``torch.distributed.Store``.

Requests and replies are frames (:mod:`phalanx.job.framing`, kind ``EVENT``): a request is an op byte, a
wait limit in milliseconds (u32) and a list of byte strings (u32 count, then u32 length + bytes each); a
reply is a status byte and a list. Ops follow ``TCPStore``'s semantics, including ``compare_set``'s.
"""

from __future__ import annotations

import socket
import struct
import threading
from collections.abc import Callable, Sequence
from enum import IntEnum

from phalanx.errors import ChannelError
from phalanx.job import handshake
from phalanx.job.auth_server import AuthServer
from phalanx.job.framing import FrameWriter, Kind, read_frame

#: Largest request an authenticated client may send.
MAX_REQUEST_BYTES = 1 << 30
_U32 = struct.Struct(">I")
_HEAD = struct.Struct(">BI")


class Op(IntEnum):
    """Store operations."""

    SET = 1
    GET = 2
    ADD = 3
    COMPARE_SET = 4
    CHECK = 5
    WAIT = 6
    DELETE = 7
    NUM_KEYS = 8
    APPEND = 9
    MULTI_GET = 10
    MULTI_SET = 11


class Status(IntEnum):
    """Reply status."""

    OK = 0
    TIMEOUT = 1
    ERROR = 2


def pack(head: int, wait_ms: int | None, items: Sequence[bytes]) -> bytes:
    """Encode a request (``wait_ms`` given) or a reply (None)."""
    parts = [_HEAD.pack(head, wait_ms or 0) if wait_ms is not None else bytes([head]), _U32.pack(len(items))]
    for item in items:
        parts += [_U32.pack(len(item)), item]
    return b"".join(parts)


def unpack(body: bytes, request: bool) -> tuple[int, int, list[bytes]]:
    """Decode :func:`pack`'s output: (op or status, wait limit in ms (0 for a reply), items).

    Raises:
        ChannelError: the body is malformed.
    """
    try:
        head, wait_ms = _HEAD.unpack_from(body) if request else (body[0], 0)
        pos = _HEAD.size if request else 1
        (count,) = _U32.unpack_from(body, pos)
        pos += _U32.size
        items = []
        for _ in range(count):
            (n,) = _U32.unpack_from(body, pos)
            pos += _U32.size
            if pos + n > len(body):
                raise ChannelError("a store message is shorter than its items")
            items.append(body[pos:pos + n])
            pos += n
    except (struct.error, IndexError) as e:
        raise ChannelError(f"malformed store message: {e}") from e
    return head, wait_ms, items


class KeyValues:
    """The store's data: a dict and a condition every change notifies (thread-safe)."""

    def __init__(self) -> None:
        self._data: dict[bytes, bytes] = {}
        self._changed = threading.Condition()
        self._closed = False

    def close(self) -> None:
        """End every wait now (it answers as a time-out): the store is going away."""
        with self._changed:
            self._closed = True
            self._changed.notify_all()

    def set_many(self, pairs: Sequence[tuple[bytes, bytes]]) -> None:
        """Set every pair at once (no reader sees some of them only)."""
        with self._changed:
            self._data.update(pairs)
            self._changed.notify_all()

    def has(self, keys: Sequence[bytes]) -> bool:
        """Whether every key is set."""
        with self._changed:
            return all(k in self._data for k in keys)

    def wait(self, keys: Sequence[bytes], timeout_s: float) -> list[bytes] | None:
        """The keys' values once all are set; None after ``timeout_s`` or once :meth:`close` was called."""
        with self._changed:
            ready = self._changed.wait_for(lambda: self._closed or all(k in self._data for k in keys), timeout_s)
            if not ready or not all(k in self._data for k in keys):
                return None
            return [self._data[k] for k in keys]

    def update(self, key: bytes, change: Callable[[bytes | None], tuple[bytes | None, bytes]]) -> bytes:
        """Atomically replace ``key``'s value by ``change(old)[0]`` (None: leave it); return ``[1]``."""
        with self._changed:
            new, reply = change(self._data.get(key))
            if new is not None:
                self._data[key] = new
                self._changed.notify_all()
            return reply

    def delete(self, key: bytes) -> bool:
        """Remove ``key``; whether it was there."""
        with self._changed:
            return self._data.pop(key, None) is not None

    def __len__(self) -> int:
        with self._changed:
            return len(self._data)

    def values(self) -> list[bytes]:
        """Every value (a copy of the list)."""
        with self._changed:
            return list(self._data.values())


def _add(delta: bytes) -> Callable[[bytes | None], tuple[bytes | None, bytes]]:
    def change(old: bytes | None) -> tuple[bytes | None, bytes]:
        value = str(int(old or b"0") + int(delta)).encode()
        return value, value
    return change


def _compare_set(expected: bytes, desired: bytes) -> Callable[[bytes | None], tuple[bytes | None, bytes]]:
    def change(old: bytes | None) -> tuple[bytes | None, bytes]:
        if old is None:  # TCPStore's rule: a missing key is set only when nothing was expected
            return (desired, desired) if not expected else (None, expected)
        return (desired, desired) if old == expected else (None, old)
    return change


def serve_request(data: KeyValues, op: int, wait_s: float, items: list[bytes]) -> tuple[Status, list[bytes]]:
    """Apply one request to ``data``; (status, reply items). Reads wait up to ``wait_s`` for their keys.

    Raises:
        ChannelError: an unknown op or the wrong number of items.
        ValueError: ADD of a value that is not an integer.
    """
    if op in (Op.GET, Op.WAIT, Op.MULTI_GET):
        values = data.wait(items, wait_s)
        if values is None:
            return Status.TIMEOUT, []
        return Status.OK, [] if op == Op.WAIT else values
    return Status.OK, _apply(data, op, items)


def _apply(data: KeyValues, op: int, items: list[bytes]) -> list[bytes]:
    if op == Op.SET and len(items) == 2:
        data.set_many([(items[0], items[1])])
        return []
    if op == Op.ADD and len(items) == 2:
        return [data.update(items[0], _add(items[1]))]
    if op == Op.COMPARE_SET and len(items) == 3:
        return [data.update(items[0], _compare_set(items[1], items[2]))]
    if op == Op.CHECK:
        return [b"1" if data.has(items) else b"0"]
    if op == Op.DELETE and len(items) == 1:
        return [b"1" if data.delete(items[0]) else b"0"]
    if op == Op.NUM_KEYS:
        return [str(len(data)).encode()]
    if op == Op.APPEND and len(items) == 2:
        data.update(items[0], lambda old: ((old or b"") + items[1], b""))
        return []
    if op == Op.MULTI_SET and len(items) % 2 == 0:
        data.set_many(list(zip(items[::2], items[1::2], strict=True)))
        return []
    raise ChannelError(f"unknown store request: op {op} with {len(items)} items")


class StoreServer:
    """Serves :class:`KeyValues` to authenticated clients (role ``STORE``); the listening socket is bound on
    construction (:class:`phalanx.job.auth_server.AuthServer`).

    Args:
        secret: the job's secret (hex).
        bind_host: address to listen on.
    """

    def __init__(self, secret: str, bind_host: str = "127.0.0.1") -> None:
        self.data = KeyValues()
        self._server = AuthServer(secret, bind_host, lambda _rank, role: role is handshake.Role.STORE,
                                  self._answer, name="phalanx-store")
        self.port: int = self._server.port

    def close(self) -> None:
        """Stop accepting, end the waits in progress and close every connection (clients' waits fail at
        once; no thread serving one outlives the store)."""
        self.data.close()
        self._server.close()

    def _answer(self, conn: socket.socket, _who: tuple[int, handshake.Role]) -> None:
        writer = FrameWriter(conn)
        while True:
            frame = read_frame(conn, limit=MAX_REQUEST_BYTES)
            if frame is None or frame[0] is not Kind.EVENT:
                return
            op, wait_ms, items = unpack(frame[1], request=True)
            try:
                status, reply = serve_request(self.data, op, wait_ms / 1000.0, items)
            except ValueError as e:
                status, reply = Status.ERROR, [str(e).encode()]
            writer.send(Kind.EVENT, pack(status, None, reply))
