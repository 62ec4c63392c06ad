"""Worker output: read line by line from pipes, written to the driver's console and to files.

Lines are never truncated or dropped: a pipe is read with ``readline`` (no length limit) and a last line
without a newline is still delivered. Console output is written to whatever ``sys.stdout`` /
``sys.stderr`` are at the moment of writing, so notebooks that swap them show the lines.
"""

from __future__ import annotations

import sys
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import IO, Protocol

from phalanx.job.records import LogLine, Stream

#: Characters of one log line kept in an error report (the console and files get the whole line).
TAIL_LINE_CHARS = 1000


class LogSink(Protocol):
    """Something that takes log lines (console, files, a tail buffer)."""

    def write(self, line: LogLine) -> None:
        """Take one line."""

    def flush(self) -> None:
        """Push out what was written."""


def pump_lines(pipe: IO[bytes], rank: int, stream: Stream, emit: Callable[[LogLine], None]) -> None:
    """Read ``pipe`` to its end, emitting one :class:`LogLine` per line (run in a thread)."""
    with pipe:
        for raw in iter(pipe.readline, b""):
            text = raw.decode("utf-8", "replace")
            emit(LogLine(rank=rank, stream=stream, text=text[:-1] if text.endswith("\n") else text))


class ConsoleSink:
    """Writes ``[rank]<stdout>:text`` lines (horovodrun's prefix) to the driver's own streams.

    With ``timestamp`` the prefix starts with the local time as horovodrun's
    ``--prefix-output-with-timestamp`` writes it (``time.asctime``: ``Tue Nov 24 22:40:05 2026[0]<stdout>:``).
    """

    def __init__(self, prefix: bool = True, timestamp: bool = False) -> None:
        self.prefix = prefix
        self.timestamp = timestamp

    def write(self, line: LogLine) -> None:
        """Write one line to sys.stdout or sys.stderr."""
        out = sys.stdout if line.stream is Stream.STDOUT else sys.stderr
        head = f"[{line.rank}]<{line.stream.label}>:" if self.prefix else ""
        if self.timestamp:
            head = time.asctime() + head
        out.write(f"{head}{line.text}\n")

    def flush(self) -> None:
        """Flush both streams."""
        sys.stdout.flush()
        sys.stderr.flush()


class FileSink:
    """Keeps each rank's output in ``DIR/rank.N/stdout`` and ``DIR/rank.N/stderr`` (horovodrun's layout)."""

    def __init__(self, directory: str | Path) -> None:
        self.directory = Path(directory)
        self._files: dict[tuple[int, Stream], IO[str]] = {}

    def _file(self, rank: int, stream: Stream) -> IO[str]:
        key = (rank, stream)
        if key not in self._files:
            folder = self.directory / f"rank.{rank}"
            folder.mkdir(parents=True, exist_ok=True)
            self._files[key] = open(folder / stream.label, "a", encoding="utf-8", errors="replace")
        return self._files[key]

    def write(self, line: LogLine) -> None:
        """Append one line to the rank's file."""
        self._file(line.rank, line.stream).write(line.text + "\n")

    def flush(self) -> None:
        """Flush every open file."""
        for f in self._files.values():
            f.flush()

    def close(self) -> None:
        """Close every open file."""
        for f in self._files.values():
            f.close()
        self._files.clear()


class TailBuffer:
    """The last lines of each rank, for error reports."""

    def __init__(self, lines: int = 20) -> None:
        self._lines = lines
        self._tails: dict[int, deque[str]] = {}

    def write(self, line: LogLine) -> None:
        """Remember a line (cut to TAIL_LINE_CHARS in the report only)."""
        text = line.text
        if len(text) > TAIL_LINE_CHARS:
            text = text[:TAIL_LINE_CHARS] + f"... ({len(line.text) - TAIL_LINE_CHARS} more characters)"
        self._tails.setdefault(line.rank, deque(maxlen=self._lines)).append(text)

    def flush(self) -> None:
        """Nothing to flush."""

    def tail(self, rank: int) -> tuple[str, ...]:
        """The remembered lines of ``rank``, oldest first."""
        return tuple(self._tails.get(rank, ()))
