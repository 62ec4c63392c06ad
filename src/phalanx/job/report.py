"""Read a rank's Python traceback as a user does: where in *their* code it failed, without phalanx's frames.

A traceback reaches the driver as text: from a function rank's error record, or from the last lines a
command rank printed (Python's own report, possibly behind a prefix such as torch's ``[rank1]: ``). The
frames inside phalanx's package (the launcher's shipping and the collectives' internals) say nothing about
the user's bug: :func:`trim` folds each run of them into one line. :func:`user_frame` is the innermost
frame outside phalanx and outside the interpreter's libraries: the user's file and line.
"""

from __future__ import annotations

import functools
import re
import sys
import sysconfig
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from phalanx.errors import WorkerFailedError

F = TypeVar("F", bound=Callable[..., Any])

#: phalanx's package directory (job/ -> phalanx/); frames under it are phalanx's.
PHALANX_DIR = str(Path(__file__).resolve().parents[1]) + "/"
_FRAME = re.compile(r'^(?P<prefix>.*?)File "(?P<file>[^"]+)", line (?P<line>\d+), in (?P<func>.+)$')
_START = "Traceback (most recent call last):"


@dataclass(frozen=True)
class Frame:
    """One ``File "...", line N, in f`` entry of a traceback."""

    file: str
    line: int
    func: str

    def where(self) -> str:
        """``path:line in func``."""
        return f"{self.file}:{self.line} in {self.func}"


def _library_dirs() -> tuple[str, ...]:
    paths = sysconfig.get_paths()
    dirs = {paths.get(k) for k in ("stdlib", "platstdlib", "purelib", "platlib")} | {sys.base_prefix + "/lib/"}
    return tuple(sorted(d.rstrip("/") + "/" for d in dirs if d))


_LIBRARIES = _library_dirs()


def is_phalanx(file: str) -> bool:
    """Whether a frame's file is phalanx's own (this installation's, or any ``site-packages/phalanx``)."""
    return file.startswith(PHALANX_DIR) or "/site-packages/phalanx/" in file


def _is_library(file: str) -> bool:
    return file.startswith(_LIBRARIES) or file.startswith("<frozen ")


def last_traceback(lines: Sequence[str]) -> list[str]:
    """The last Python traceback in ``lines`` (from its ``Traceback`` line to the exception line), with
    the prefix its lines share removed; empty when there is none."""
    start = max((i for i, ln in enumerate(lines) if ln.rstrip().endswith(_START)), default=-1)
    if start < 0:
        return []
    prefix = lines[start][: lines[start].rstrip().rfind(_START)]
    block = [ln[len(prefix):] if ln.startswith(prefix) else ln for ln in lines[start:]]
    end = next((i for i, ln in enumerate(block) if i > 0 and ln and not ln[0].isspace()), len(block) - 1)
    return block[: end + 1]


def frames(lines: Sequence[str]) -> list[Frame]:
    """The frames of a traceback's lines, outermost first."""
    out = []
    for ln in lines:
        m = _FRAME.match(ln.strip())
        if m:
            out.append(Frame(m["file"], int(m["line"]), m["func"]))
    return out


def user_frame(found: Sequence[Frame]) -> Frame | None:
    """The innermost frame of the user's code: outside phalanx and the interpreter's libraries (else
    outside phalanx); None when every frame is phalanx's."""
    own = [f for f in found if not is_phalanx(f.file)]
    mine = [f for f in own if not _is_library(f.file)]
    chosen = mine or own
    return chosen[-1] if chosen else None


def trim(text: str) -> tuple[str, int]:
    """``text`` (a traceback) with each run of phalanx frames (with their source lines) folded into one
    ``[N frames in phalanx]`` line; returns it with the number of frames hidden. The innermost frame
    stays when it is phalanx's: it says where the error was raised."""
    lines = text.rstrip("\n").splitlines()
    frame_at = [i for i, ln in enumerate(lines) if _FRAME.match(ln.strip())]
    last = frame_at[-1] if frame_at else -1
    out: list[str] = []
    hidden = run = 0
    skipping = False
    for i, ln in enumerate(lines):
        m = _FRAME.match(ln.strip())
        if m:
            skipping = is_phalanx(m["file"]) and i != last
            if skipping:
                run += 1
                continue
        elif skipping and ln.startswith("    "):
            continue  # the hidden frame's source line and its ^^^ marks
        if run:
            out.append(f"  [{run} frame{'s' if run > 1 else ''} in phalanx]")
            hidden, run = hidden + run, 0
        skipping = False
        out.append(ln)
    return "\n".join(out) + "\n", hidden


@dataclass(frozen=True)
class FoundFailure:
    """What a failed rank's traceback says: the user's frame, the folded text, and where it came from."""

    traceback: str = ""
    where: str = ""
    from_output: bool = False
    exception: str = ""


def read_failure(recorded: str, output: Sequence[str]) -> FoundFailure:
    """Read a failed rank's traceback: ``recorded`` (a function rank's error record) or else the last one
    in its ``output`` lines (a command rank's, which the console has already shown)."""
    lines = recorded.splitlines() if recorded else last_traceback(output)
    if not lines:
        return FoundFailure()
    frame = user_frame(frames(lines))
    text, _ = trim("\n".join(lines))
    exception = next((ln.strip() for ln in reversed(lines) if ln.strip()), "")
    return FoundFailure(text, frame.where() if frame else "", not recorded, exception)


def entry_point(name: str) -> Callable[[F], F]:
    """Decorate a public launcher (``phalanx.run``, ``HorovodRunner.run``...) so that what reaches the
    user reads as from ``phalanxrun``: a failed job's :class:`WorkerFailedError` without the driver's
    phalanx frames before the report, and Ctrl-C as one line, ``NAME: interrupted; all ranks were stopped``
    (the launcher has stopped them by then), before ``KeyboardInterrupt`` is re-raised."""

    def decorate(fn: F) -> F:
        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            try:
                return fn(*args, **kwargs)
            except WorkerFailedError as e:
                raise e.with_traceback(None) from None  # the report says where: not the launcher's frames
            except KeyboardInterrupt:
                sys.stderr.write(f"{name}: interrupted; all ranks were stopped\n")
                sys.stderr.flush()
                raise KeyboardInterrupt from None

        return wrapper  # type: ignore[return-value]

    return decorate
