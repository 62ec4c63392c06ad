"""Frames cut from a connection's bytes as they arrive, for a server that reads many connections on one thread.

:class:`FrameParser` takes whatever one ``recv`` returned, however it splits frames, and hands each whole
frame to its connection's :class:`Session`. A body the session wants elsewhere (a large result: a file) is
written there piece by piece as it arrives, never held whole. The bounds of
:func:`phalanx.job.framing.read_frame` hold: a frame of an unknown kind or with a body over the session's
limit ends the connection before any of its body is kept.
"""

from __future__ import annotations

import struct
from typing import Protocol

from phalanx.errors import ChannelError
from phalanx.job.framing import HEADER_BYTES, Kind

_HEADER = struct.Struct(">BQ")
_KINDS = {int(kind): kind for kind in Kind}


class BodySink(Protocol):
    """Where a frame's body goes piece by piece (a file, for a large result)."""

    def write(self, data: memoryview, /) -> object:
        """Take the next piece."""


class Session(Protocol):
    """What a server does with one authenticated connection's frames. Every call comes from the server's
    one reading thread, so a session needs no lock of its own for what only these calls touch."""

    #: Largest frame body the peer may send, in bytes.
    limit: int

    def sink(self, kind: Kind, length: int) -> BodySink | None:
        """Where the body of the frame just begun goes; None: to :meth:`frame`, whole, as bytes."""

    def frame(self, kind: Kind, body: bytes | BodySink) -> None:
        """One whole frame (``body`` is the sink :meth:`sink` gave, now holding all of it).

        Raises:
            ChannelError, OSError, ValueError: the peer broke the protocol: its connection is closed.
        """

    def ended(self, error: BaseException | None) -> None:
        """The connection is closed (by the peer: ``error`` None; after a failure: that failure)."""


class FrameParser:
    """Cuts one connection's bytes into frames for its session.

    Args:
        session: receives the frames.
    """

    def __init__(self, session: Session) -> None:
        self._session = session
        self._buf = bytearray()
        self._kind: Kind | None = None  # the frame in progress, after its header
        self._left = 0  # body bytes of it still to come
        self._sink: BodySink | None = None

    def feed(self, data: bytes) -> None:
        """Take the next bytes; every frame they complete goes to the session, in order.

        Raises:
            ChannelError: an unknown kind or a body over the session's limit.
            Exception: whatever the session raised for a frame (the connection is then beyond use).
        """
        buf = self._buf
        buf += data
        pos, end = 0, len(buf)
        while True:
            if self._kind is None:
                if end - pos < HEADER_BYTES:
                    break
                self._begin(buf, pos)
                pos += HEADER_BYTES
            if self._sink is not None:
                take = min(self._left, end - pos)
                if take:
                    self._sink.write(memoryview(buf[pos:pos + take]))
                pos += take
                self._left -= take
                if self._left:
                    break
                body: bytes | BodySink = self._sink
            elif end - pos >= self._left:
                body = bytes(buf[pos:pos + self._left])
                pos += self._left
            else:
                break
            kind, self._kind, self._sink = self._kind, None, None
            assert kind is not None
            self._session.frame(kind, body)
        del buf[:pos]

    def _begin(self, buf: bytearray, pos: int) -> None:
        raw, length = _HEADER.unpack_from(buf, pos)
        kind = _KINDS.get(raw)
        if kind is None:
            raise ChannelError(f"unknown frame kind {raw}")
        if length > self._session.limit:
            raise ChannelError(f"{kind.name} frame of {length} bytes is over the limit of "
                               f"{self._session.limit} bytes")
        self._kind, self._left = kind, length
        self._sink = self._session.sink(kind, length)
