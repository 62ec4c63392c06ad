"""Large rank results kept in a file on the driver, not in its memory, until they are loaded.

A rank's result arrives as one ``RESULT`` frame. Above :data:`SPOOL_BYTES` the channel writes the frame's
body to an unlinked temporary file as it arrives (:class:`SpoolWriter`, then :class:`Spooled`), and the
monitor unpickles it from there once the job succeeded: the driver then holds each result once, as the
object the user gets, instead of the received bytes, the pieces they were joined from and the object. The
file has no name (it is unlinked at creation), so nothing is left behind by a failed or killed driver.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from typing import Any, BinaryIO

import cloudpickle

#: Results larger than this (bytes) are spooled to a file as they arrive.
SPOOL_BYTES = 1 << 20


class SpoolError(OSError):
    """A result could not be written to the driver's temporary directory (a full disk, most often); the
    message names the directory, its free space and ``TMPDIR``."""


class _GuardedFile:
    """``file``'s ``write`` with a failure turned into a :class:`SpoolError` (socket errors stay apart)."""

    def __init__(self, file: BinaryIO, length: int) -> None:
        self._file, self._length = file, length

    def write(self, data: memoryview) -> object:
        try:
            return self._file.write(data)
        except OSError as e:
            raise spool_error(self._length, e) from e

    def flush(self) -> None:
        try:
            self._file.flush()
        except OSError as e:
            raise spool_error(self._length, e) from e


def spool_error(length: int, e: OSError) -> SpoolError:
    """The error for a result of ``length`` bytes that could not be spooled because of ``e``."""
    folder = tempfile.gettempdir()
    try:
        free = f"{shutil.disk_usage(folder).free / 2**20:.1f} MiB free"
    except OSError:
        free = "free space unknown"
    tmpdir = os.environ.get("TMPDIR")
    return SpoolError(
        e.errno, f"the driver could not keep a result of {length / 2**20:.1f} MiB: {e.strerror or e} writing a "
        f"temporary file in {folder} ({free}; TMPDIR={tmpdir if tmpdir is not None else 'unset'}); free space "
        "there or point TMPDIR at a directory with room for the results")


class SpoolWriter:
    """A result's body written to a new spool file piece by piece as it arrives.

    Args:
        length: the body's length in bytes.

    Raises:
        SpoolError: the file could not be created.
    """

    def __init__(self, length: int) -> None:
        try:
            self._file = tempfile.TemporaryFile(prefix="phalanx-result-")
        except OSError as e:
            raise spool_error(length, e) from e
        self._guarded = _GuardedFile(self._file, length)
        self._length = length

    def write(self, data: memoryview) -> object:
        """Append the next piece.

        Raises:
            SpoolError: it could not be written (a full disk).
        """
        return self._guarded.write(data)

    def finish(self) -> Spooled:
        """The whole body, written: the file now belongs to the returned :class:`Spooled`.

        Raises:
            SpoolError: the last pieces could not be written.
        """
        try:
            self._guarded.flush()
        except BaseException:
            self._file.close()
            raise
        return Spooled(self._file, self._length)

    def discard(self) -> None:
        """Drop what was written (the body will not be finished)."""
        self._file.close()


class Spooled:
    """A frame body in an unlinked temporary file.

    Args:
        file: the open file holding the body from offset 0.
        size: the body's length in bytes.
    """

    def __init__(self, file: BinaryIO, size: int) -> None:
        self.file = file
        self.size = size

    def __len__(self) -> int:
        return self.size

    def read(self) -> bytes:
        """The whole body (then the file is closed)."""
        with self.file as f:
            f.seek(0)
            return f.read()

    def load(self) -> Any:
        """Unpickle the body straight from the file (then the file is closed).

        Raises:
            Exception: whatever unpickling raises.
        """
        with self.file as f:
            f.seek(0)
            return cloudpickle.load(f)

    def close(self) -> None:
        """Drop the body (its disk space is freed)."""
        self.file.close()
