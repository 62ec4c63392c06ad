"""What a starting job waits for, told as it happens (a job can be silent for seconds, on Spark 15-40 s).

On a terminal the steps share one line, each replacing the last, erased once the ranks run or their
first line arrives; elsewhere (a log, a notebook's captured stderr) each step is a plain ``phalanx:`` line,
and a count (``ranks started k/N``) is written once, when it is complete, rather than once per rank.
``Progress(enabled=False)`` (``phalanxrun -q``, ``phalanx.run(quiet=True)``, ``phalanx.spark.run(verbose=0)``)
says nothing. Once :meth:`Progress.finish` is called the start is over: later steps (an elastic job's
replacement ranks) say nothing either.
"""

from __future__ import annotations

import sys
from typing import IO


class Progress:
    """Steps of a job's start on ``stream`` (default ``sys.stderr``)."""

    def __init__(self, enabled: bool = True, stream: IO[str] | None = None) -> None:
        self.enabled = enabled
        self._stream = stream
        self._open = False
        self._last = ""

    @property
    def stream(self) -> IO[str]:
        """Where the steps go."""
        return self._stream or sys.stderr

    def _tty(self) -> bool:
        isatty = getattr(self.stream, "isatty", None)
        return bool(isatty and isatty())

    def step(self, text: str) -> None:
        """Say that the job now waits for ``text`` (repeats are dropped)."""
        if not self.enabled or text == self._last:
            return
        self._last = text
        if self._tty():
            self.stream.write(f"\r\033[Kphalanx: {text}")
            self._open = True
        else:
            self.stream.write(f"phalanx: {text}\n")
        self.stream.flush()

    def count(self, what: str, done: int, total: int) -> None:
        """Say ``what done/total``: on a terminal at every change, elsewhere only once complete."""
        if done >= total or (self.enabled and self._tty()):
            self.step(f"{what} {done}/{total}")

    def clear(self) -> None:
        """Erase the terminal's progress line (before other output, or once the job runs)."""
        if self._open:
            self.stream.write("\r\033[K")
            self.stream.flush()
            self._open = False

    def finish(self) -> None:
        """The start is over: erase the line and say nothing more."""
        self.clear()
        self.enabled = False
