"""Worker output: read line by line from pipes, written to the driver's console and to files.

Lines are never truncated or dropped, and a last line without a newline is still delivered. A line
longer than :data:`PIECE_BYTES` travels in pieces (``LogLine.more``) that the sinks write one after the
other, so the driver never holds a whole multi-megabyte line (or several copies of it). Console output is
written to whatever ``sys.stdout`` / ``sys.stderr`` are at the moment of writing, so notebooks that swap
them show the lines.
"""

from __future__ import annotations

import codecs
import dataclasses
import logging
import os
import sys
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import IO, Protocol

from phalanx.env import files
from phalanx.job.records import LogLine, Stream

log = logging.getLogger(__name__)

#: Characters of one log line kept in an error report (the console and files get the whole line).
TAIL_LINE_CHARS = 1000
#: Largest piece of a line read from a rank's pipe at once.
PIECE_BYTES = 1 << 20


class LogSink(Protocol):
    """Something that takes log lines (console, files, a tail buffer)."""

    def write(self, line: LogLine) -> None:
        """Take one line."""

    def flush(self) -> None:
        """Push out what was written."""


def pump_lines(pipe: IO[bytes], rank: int, stream: Stream, emit: Callable[[LogLine], None]) -> None:
    """Read ``pipe`` to its end, emitting one :class:`LogLine` per line, or per piece of a line longer than
    :data:`PIECE_BYTES` (run in a thread). ``emit`` may block: the rank then blocks on its next write."""
    decoder = codecs.getincrementaldecoder("utf-8")("replace")
    with pipe:
        for raw in iter(lambda: pipe.readline(PIECE_BYTES), b""):
            whole = raw.endswith(b"\n") or len(raw) < PIECE_BYTES  # a short piece without "\n": the end
            text = decoder.decode(raw, final=whole)
            emit(LogLine(rank=rank, stream=stream, text=text[:-1] if text.endswith("\n") else text,
                         more=not whole))


class LineJoiner:
    """Tracks which (rank, stream) lines are open (a piece with ``more`` was written), so that a sink writes
    a line's prefix once and ends an open line before another rank's line is written to the same stream."""

    def __init__(self) -> None:
        self._open: dict[Stream, tuple[int, Stream] | None] = {}

    def piece(self, line: LogLine, head: str) -> str:
        """The text to write for ``line``: prefix (unless it continues the open line), text, newline (unless
        more follows)."""
        key = (line.rank, line.stream)
        current = self._open.get(line.stream)
        out = "" if current is None or current == key else "\n"
        out += (head if current != key else "") + line.text
        self._open[line.stream] = key if line.more else None
        return out if line.more else out + "\n"


def render_carriage_returns(text: str) -> str:
    """What a terminal shows for ``text`` once written: each ``\\r`` returns to the line's start and what
    follows overwrites it (a Keras or tqdm progress bar redrawn in place shows as its last state)."""
    if "\r" not in text:
        return text
    screen = ""
    for part in text.split("\r"):
        screen = part + screen[len(part):]
    return screen


class ConsoleSink:
    """Writes ``[rank]<stdout>:text`` lines (horovodrun's prefix) to the driver's own streams.

    With ``timestamp`` the prefix starts with the local time as horovodrun's
    ``--prefix-output-with-timestamp`` writes it (``time.asctime``: ``Tue Nov 24 22:40:05 2026[0]<stdout>:``;
    without the rank prefix a space separates it from the text). A line redrawn with ``\\r`` shows as a
    terminal would show it (:func:`render_carriage_returns`); the ``--output-filename`` files keep it as
    written.
    """

    def __init__(self, prefix: bool = True, timestamp: bool = False) -> None:
        self.prefix = prefix
        self.timestamp = timestamp
        self._joiner = LineJoiner()

    def write(self, line: LogLine) -> None:
        """Write one line (or piece) to sys.stdout or sys.stderr."""
        out = sys.stdout if line.stream is Stream.STDOUT else sys.stderr
        head = f"[{line.rank}]<{line.stream.label}>:" if self.prefix else ""
        if self.timestamp:
            head = time.asctime() + (head or " ")
        if "\r" in line.text:
            line = dataclasses.replace(line, text=render_carriage_returns(line.text))
        out.write(self._joiner.piece(line, head))

    def flush(self) -> None:
        """Flush both streams."""
        sys.stdout.flush()
        sys.stderr.flush()


class FileSink:
    """Keeps each rank's output in ``DIR/rank.N/stdout`` and ``DIR/rank.N/stderr`` (horovodrun's layout).

    ``DIR`` must be this user's (it is created 0700 when missing); the files are created 0600 and never
    through a link or into a FIFO another user planted (:mod:`phalanx.env.files`). A write that fails (a
    full disk) does not end the job: the sink warns once, naming the directory and ``setting``, and stops
    writing files; the console still gets every line.

    Args:
        directory: the output directory.
        setting: the option that named it, for messages.

    Raises:
        UnsafePathError: ``directory`` belongs to another user or is not a directory.
        OSError: it cannot be created.
    """

    def __init__(self, directory: str | Path, setting: str = "--output-filename") -> None:
        self.directory = Path(directory)
        self._setting = setting
        self._dir_fd = files.open_dir(self.directory, setting)
        self._files: dict[tuple[int, Stream], IO[str]] = {}
        self._failed = False

    def _file(self, rank: int, stream: Stream) -> IO[str]:
        key = (rank, stream)
        if key not in self._files:
            rank_fd = files.subdir(self._dir_fd, f"rank.{rank}", self._setting)
            try:
                fd = files.open_file(rank_fd, stream.label, self._setting)
            finally:
                os.close(rank_fd)
            self._files[key] = os.fdopen(fd, "a", encoding="utf-8", errors="replace")
        return self._files[key]

    def write(self, line: LogLine) -> None:
        """Append one line (or piece) to the rank's file."""
        if self._failed:
            return
        try:
            f = self._file(line.rank, line.stream)
            f.write(line.text)
            if not line.more:
                f.write("\n")
        except OSError as e:
            self._give_up(e)

    def flush(self) -> None:
        """Flush every open file."""
        if self._failed:
            return
        try:
            for f in self._files.values():
                f.flush()
        except OSError as e:
            self._give_up(e)

    def _give_up(self, e: OSError) -> None:
        self._failed = True
        log.warning("could not write the ranks' output files under %s (%s): the job goes on and its output "
                    "still reaches the console, but the files stop here; free space there or choose another "
                    "directory with %s", self.directory, e, self._setting)
        self._close_files()

    def _close_files(self) -> None:
        for f in self._files.values():
            try:
                f.close()
            except OSError:  # the buffered tail could not be written either (the disk is still full)
                pass
        self._files.clear()

    def close(self) -> None:
        """Close every open file."""
        self._close_files()
        if self._dir_fd >= 0:
            os.close(self._dir_fd)
            self._dir_fd = -1


class TailBuffer:
    """The last lines of each rank, for error reports."""

    def __init__(self, lines: int = 20) -> None:
        self._lines = lines
        self._tails: dict[int, deque[str]] = {}
        self._open: dict[tuple[int, Stream], int] = {}  # line still in pieces -> characters it has so far

    def write(self, line: LogLine) -> None:
        """Remember a line (cut to TAIL_LINE_CHARS in the report only); pieces of a line make one entry."""
        tail = self._tails.setdefault(line.rank, deque(maxlen=self._lines))
        key = (line.rank, line.stream)
        before = self._open.pop(key, None)
        if before is None:
            tail.append(line.text[:TAIL_LINE_CHARS])
            before = 0
        elif before < TAIL_LINE_CHARS and tail:
            tail[-1] = (tail[-1] + line.text)[:TAIL_LINE_CHARS]
        total = before + len(line.text)
        if line.more:
            self._open[key] = total
        elif total > TAIL_LINE_CHARS and tail:
            tail[-1] = tail[-1][:TAIL_LINE_CHARS] + f"... ({total - TAIL_LINE_CHARS} more characters)"

    def flush(self) -> None:
        """Nothing to flush."""

    def tail(self, rank: int) -> tuple[str, ...]:
        """The remembered lines of ``rank``, oldest first."""
        return tuple(self._tails.get(rank, ()))
