"""The records workers send to the driver, and their encoding as frame bodies.

Logs and hellos are small binary/JSON records; results are cloudpickle bytes (decoded only after the
peer authenticated); errors are JSON so that a driver can always read them, even when the worker's
exception class does not exist on the driver.
"""

from __future__ import annotations

import json
import struct
import traceback
from dataclasses import asdict, dataclass, field
from enum import IntEnum

_LOG_HEADER = struct.Struct(">IB")
_MORE = 0x80


class Stream(IntEnum):
    """Which output stream a log line came from."""

    STDOUT = 1
    STDERR = 2

    @property
    def label(self) -> str:
        """``stdout`` or ``stderr``, as horovodrun prints it."""
        return self.name.lower()


@dataclass(frozen=True)
class LogLine:
    """One line a rank wrote (without its trailing newline), or one piece of a long line.

    Attributes:
        rank: the rank that wrote it.
        stream: stdout or stderr.
        text: the text.
        more: the line goes on in the next record of this rank and stream (a line longer than
            :data:`phalanx.job.logs.PIECE_BYTES` travels in pieces, so no copy of it is ever whole).
    """

    rank: int
    stream: Stream
    text: str
    more: bool = False

    def encode(self) -> bytes:
        """Frame body: rank, stream (high bit: ``more``), then the UTF-8 text."""
        flags = int(self.stream) | (_MORE if self.more else 0)
        return _LOG_HEADER.pack(self.rank, flags) + self.text.encode("utf-8", "surrogateescape")

    @classmethod
    def decode(cls, body: bytes) -> LogLine:
        """Inverse of :meth:`encode`."""
        rank, flags = _LOG_HEADER.unpack_from(body)
        text = body[_LOG_HEADER.size :].decode("utf-8", "replace")
        return cls(rank=rank, stream=Stream(flags & ~_MORE), text=text, more=bool(flags & _MORE))


@dataclass(frozen=True)
class Hello:
    """First record of an authenticated worker: who and where it is."""

    rank: int
    pid: int
    host: str

    def encode(self) -> bytes:
        """JSON frame body."""
        return json.dumps(asdict(self)).encode()

    @classmethod
    def decode(cls, body: bytes) -> Hello:
        """Inverse of :meth:`encode`."""
        data = json.loads(body)
        return cls(rank=int(data["rank"]), pid=int(data["pid"]), host=str(data["host"]))


@dataclass(frozen=True)
class ErrorRecord:
    """An exception raised by the user's code on one rank."""

    rank: int
    exc_type: str
    message: str
    traceback: str
    #: ``time.monotonic()`` on the driver when the failure happened, for a failure the driver itself
    #: observed (an agent's death); None: when the driver hears of it. Never sent over the wire.
    at: float | None = field(default=None, compare=False)

    @classmethod
    def from_exception(cls, rank: int, exc: BaseException) -> ErrorRecord:
        """Capture an exception with its full traceback (the user's frames included)."""
        kind = type(exc)
        name = kind.__qualname__ if kind.__module__ == "builtins" else f"{kind.__module__}.{kind.__qualname__}"
        text = "".join(traceback.format_exception(kind, exc, exc.__traceback__))
        return cls(rank=rank, exc_type=name, message=str(exc), traceback=text)

    @property
    def summary(self) -> str:
        """``Type: message`` on one line."""
        first = self.message.splitlines()[0] if self.message else ""
        return f"{self.exc_type}: {first}" if first else self.exc_type

    def encode(self) -> bytes:
        """JSON frame body."""
        return json.dumps({k: v for k, v in asdict(self).items() if k != "at"}).encode()

    @classmethod
    def decode(cls, body: bytes) -> ErrorRecord:
        """Inverse of :meth:`encode`."""
        data = json.loads(body)
        return cls(
            rank=int(data["rank"]),
            exc_type=str(data["exc_type"]),
            message=str(data["message"]),
            traceback=str(data["traceback"]),
        )
