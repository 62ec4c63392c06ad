"""The job's key-value store (torch.distributed's rendezvous store), behind the channel's handshake.

torch's ``TCPStore`` answers anyone who can reach its port: another local user could rewrite the keys a
job meets by. phalanx's store speaks a protocol of its own after :mod:`phalanx.job.handshake` (role
``STORE``), so only a holder of the job's secret reads or writes a key. Ranks use it through
:class:`phalanx.job.store_client.StoreClient`, a ``torch.distributed.Store``.

Requests and replies are frames (:mod:`phalanx.job.framing`, kind ``EVENT``): a request is an op byte, a
wait limit in milliseconds (u32) and a list of byte strings (u32 count, then u32 length + bytes each); a
reply is a status byte and a list. Ops follow ``TCPStore``'s semantics, including ``compare_set``'s.

Every client is served on the server's one loop thread (:class:`phalanx.job.auth_server.AuthServer`),
never blocked: a read of keys not all set yet parks its client (:class:`_Client`) until a change that may
complete it (:meth:`KeyValues.watch`) or its wait limit (a timer of the loop). A client sends one request
at a time (``StoreClient`` holds a lock around each); any that one sends while parked is answered after.
"""

from __future__ import annotations

import socket
import struct
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from enum import IntEnum

from phalanx.errors import ChannelError
from phalanx.job import handshake
from phalanx.job.auth_server import AuthServer, Timer
from phalanx.job.frame_stream import BodySink
from phalanx.job.framing import FrameWriter, Kind

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
    """The store's data (thread-safe), and who watches for which key."""

    def __init__(self) -> None:
        self._data: dict[bytes, bytes] = {}
        self._watchers: dict[bytes, list[Callable[[], None]]] = {}
        self._lock = threading.Lock()
        self._closed = False

    def close(self) -> None:
        """Call every watcher now (its wait then answers as a time-out): the store is going away."""
        with self._lock:
            self._closed = True
            called = [fn for fns in self._watchers.values() for fn in fns]
            self._watchers.clear()
        for fn in called:
            fn()

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called."""
        return self._closed

    def set_many(self, pairs: Sequence[tuple[bytes, bytes]]) -> None:
        """Set every pair at once (no reader sees some of them only)."""
        with self._lock:
            self._data.update(pairs)
            called = self._take_watchers([k for k, _ in pairs])
        for fn in called:
            fn()

    def has(self, keys: Sequence[bytes]) -> bool:
        """Whether every key is set."""
        with self._lock:
            return all(k in self._data for k in keys)

    def get_all(self, keys: Sequence[bytes]) -> list[bytes] | None:
        """The keys' values, or None while one is not set."""
        with self._lock:
            try:
                return [self._data[k] for k in keys]
            except KeyError:
                return None

    def watch(self, keys: Sequence[bytes], fn: Callable[[], None]) -> bool:
        """Have ``fn`` called once, from the thread that sets the first of ``keys`` missing now (or closes
        the store), without a lock held; False (and no call) when every key is set already.

        Only one key is watched: the caller checks again when called, and watches the next missing one.
        """
        with self._lock:
            missing = next((k for k in keys if k not in self._data), None)
            if not self._closed:
                if missing is None:
                    return False
                self._watchers.setdefault(missing, []).append(fn)
                return True
        fn()
        return True

    def unwatch(self, keys: Sequence[bytes], fn: Callable[[], None]) -> None:
        """Forget ``fn`` (a wait that ended otherwise)."""
        with self._lock:
            for key in keys:
                fns = self._watchers.get(key)
                if fns is not None and fn in fns:
                    fns.remove(fn)
                    if not fns:
                        del self._watchers[key]

    def update(self, key: bytes, change: Callable[[bytes | None], tuple[bytes | None, bytes]]) -> bytes:
        """Atomically replace ``key``'s value by ``change(old)[0]`` (None: leave it); return ``[1]``."""
        with self._lock:
            new, reply = change(self._data.get(key))
            called = []
            if new is not None:
                self._data[key] = new
                called = self._take_watchers([key])
        for fn in called:
            fn()
        return reply

    def delete(self, key: bytes) -> bool:
        """Remove ``key``; whether it was there."""
        with self._lock:
            return self._data.pop(key, None) is not None

    def __len__(self) -> int:
        with self._lock:
            return len(self._data)

    def values(self) -> list[bytes]:
        """Every value (a copy of the list)."""
        with self._lock:
            return list(self._data.values())

    def _take_watchers(self, keys: Sequence[bytes]) -> list[Callable[[], None]]:
        out: list[Callable[[], None]] = []
        for key in keys:
            out += self._watchers.pop(key, ())
        return out


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


_READS = (Op.GET, Op.WAIT, Op.MULTI_GET)


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
                                  self._open, name="phalanx-store")
        self.port: int = self._server.port

    def close(self) -> None:
        """Stop accepting, end the waits in progress and close every connection (clients' waits fail at
        once; nothing serving one outlives the store)."""
        self.data.close()
        self._server.close()

    def _open(self, conn: socket.socket, _who: tuple[int, handshake.Role]) -> _Client:
        return _Client(self.data, FrameWriter(conn), self._server)


class _Client:
    """One client's requests, answered in order on the server's loop (a
    :class:`phalanx.job.frame_stream.Session`)."""

    limit = MAX_REQUEST_BYTES

    def __init__(self, data: KeyValues, writer: FrameWriter, server: AuthServer) -> None:
        self._data, self._writer, self._server = data, writer, server
        self._parked: tuple[list[bytes], float, Timer] | None = None  # a read's keys, deadline, timer
        self._queued: deque[bytes] = deque()  # requests sent while parked
        self._gone = False

    def sink(self, kind: Kind, length: int) -> BodySink | None:
        return None

    def frame(self, kind: Kind, body: bytes | BodySink) -> None:
        if kind is not Kind.EVENT or not isinstance(body, bytes):
            raise ChannelError(f"a store client may not send {kind.name} frames")
        self._queued.append(body)
        self._serve_queued()

    def ended(self, error: BaseException | None) -> None:
        self._gone = True
        self._unpark()

    def _serve_queued(self) -> None:
        while self._queued and self._parked is None and not self._gone:
            op, wait_ms, items = unpack(self._queued.popleft(), request=True)
            if op in _READS:
                self._read(op, items, time.monotonic() + wait_ms / 1000.0)
                continue
            try:
                reply = _apply(self._data, op, items)
            except ValueError as e:
                self._reply(Status.ERROR, [str(e).encode()])
            else:
                self._reply(Status.OK, reply)

    def _read(self, op: int, items: list[bytes], deadline: float) -> None:
        """Answer a read now, or park until its keys may be set or its deadline passes."""
        values = self._data.get_all(items)
        if values is not None:
            self._reply(Status.OK, [] if op == Op.WAIT else values)
        elif self._data.closed or time.monotonic() >= deadline:
            self._reply(Status.TIMEOUT, [])
        else:
            timer = self._server.call_at(deadline, lambda: self._resume(op, items, deadline))
            self._parked = (items, deadline, timer)
            if not self._data.watch(items, self._changed):
                self._server.call_soon(lambda: self._resume(op, items, deadline))

    def _changed(self) -> None:
        """A watched key was set (on any thread): the loop looks again."""
        parked = self._parked
        if parked is not None:
            self._server.call_soon(parked[2].fn)

    def _resume(self, op: int, items: list[bytes], deadline: float) -> None:
        if self._parked is None or self._parked[0] is not items or self._gone:
            return  # answered already (a change and the deadline both called)
        self._unpark()
        self._read(op, items, deadline)
        self._serve_queued()

    def _unpark(self) -> None:
        if self._parked is not None:
            items, _, timer = self._parked
            self._parked = None
            timer.cancel()
            self._data.unwatch(items, self._changed)

    def _reply(self, status: Status, items: list[bytes]) -> None:
        try:
            self._writer.send(Kind.EVENT, pack(status, None, items))
        except ChannelError:  # the client is gone: the loop reads its end next
            self._gone = True
