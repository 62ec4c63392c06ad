"""Shared-memory segments: create, attach, unlink (POSIX shm through ``/dev/shm`` files and ``mmap``).

A segment is unlinked as soon as every member has mapped it, so it lives only as long as the mappings:
nothing is left in ``/dev/shm`` after success, failure or SIGKILL of any rank. Only the setup window (create
→ every rank attached, a few milliseconds) could leak a name if the creator is killed in it; the next
creator on the host removes segments whose creator process no longer exists (the pid is in the name).

Plain files and ``mmap`` rather than ``multiprocessing.shared_memory``: that module's resource tracker
registers attached segments too (Python < 3.13) and unlinks or warns about them behind our back.
"""

from __future__ import annotations

import mmap
import os
import secrets
import stat
from collections.abc import Callable
from dataclasses import dataclass

from phalanx.env.shm import NAME_PATTERN, PREFIX, SHM_DIR

__all__ = ["NAME_PATTERN", "PREFIX", "SHM_DIR", "Segment", "attach", "create", "make_fifo", "open_fifo", "unlink"]


@dataclass
class Segment:
    """A mapped shared-memory segment.

    Attributes:
        name: the file name under ``/dev/shm`` (already unlinked once every member attached).
        buf: the writable mapping.
    """

    name: str
    buf: mmap.mmap

    def close(self) -> None:
        """Unmap (views into the mapping must be gone; a live view makes this a no-op until then)."""
        try:
            self.buf.close()
        except BufferError:
            pass  # torch/numpy views still reference it; the mapping goes when they do


def _path(name: str) -> str:
    """``/dev/shm/<name>`` for a name this module made.

    Raises:
        OSError: ``name`` is not one (a path, ``..``, anything else read from outside).
    """
    if not NAME_PATTERN.fullmatch(name):
        raise OSError(f"{name!r} is not a phalanx shared-memory name; refusing to use it as a path")
    return os.path.join(SHM_DIR, name)


def _open_own(name: str, flags: int, kind: Callable[[int], bool]) -> int:
    """Open a peer's file under ``/dev/shm`` only if it is not a symbolic link, is of the expected kind
    and belongs to this user (another user's file of that name is never written to).

    Raises:
        OSError: it is missing, a link, of another kind or another user's.
    """
    fd = os.open(_path(name), flags | os.O_NOFOLLOW)
    info = os.fstat(fd)
    if not kind(info.st_mode) or info.st_uid != os.geteuid():
        os.close(fd)
        raise OSError(f"{SHM_DIR}/{name} is not this user's phalanx file (uid {info.st_uid}); not using it")
    return fd


def available() -> bool:
    """Whether this host has a POSIX shared-memory directory."""
    return os.path.isdir(SHM_DIR) and os.access(SHM_DIR, os.W_OK)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def sweep_stale() -> None:
    """Remove phalanx segments whose creating process no longer exists (a creator killed during setup)."""
    try:
        names = os.listdir(SHM_DIR)
    except OSError:
        return
    for name in names:
        if not name.startswith(PREFIX):
            continue
        pid_text = name[len(PREFIX) :].split("-", 1)[0]
        if pid_text.isdigit() and not _pid_alive(int(pid_text)):
            try:
                os.unlink(os.path.join(SHM_DIR, name))  # a directory entry: never a path elsewhere
            except OSError:
                pass  # another creator removed it first


def create(nbytes: int) -> Segment:
    """Create and map a zero-filled segment of ``nbytes`` whose pages are reserved up front.

    Raises:
        OSError: ``/dev/shm`` is missing or too small (``posix_fallocate`` reserves the pages, so a full
            tmpfs fails here instead of with SIGBUS on first touch).
    """
    sweep_stale()
    name = f"{PREFIX}{os.getpid()}-{secrets.token_hex(6)}"
    fd = os.open(_path(name), os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.posix_fallocate(fd, 0, max(nbytes, 1))
        buf = mmap.mmap(fd, max(nbytes, 1))
    except OSError:
        os.unlink(_path(name))
        raise
    finally:
        os.close(fd)
    return Segment(name=name, buf=buf)


def attach(name: str, nbytes: int) -> Segment:
    """Map an existing segment created by a peer.

    Raises:
        OSError: ``name`` is not a phalanx name, or the segment does not exist here (the peer is on another
            host or in another mount namespace), is not this user's, or has another size.
    """
    fd = _open_own(name, os.O_RDWR, stat.S_ISREG)
    try:
        if os.fstat(fd).st_size != max(nbytes, 1):
            raise OSError(f"shared-memory segment {name} has {os.fstat(fd).st_size} bytes, expected {nbytes}")
        buf = mmap.mmap(fd, max(nbytes, 1))
    finally:
        os.close(fd)
    return Segment(name=name, buf=buf)


def unlink(name: str) -> None:
    """Remove the segment's name (mappings stay valid); a missing name is fine."""
    try:
        os.unlink(_path(name))
    except FileNotFoundError:
        pass


def make_fifo() -> tuple[str, int]:
    """Create this rank's wake-up FIFO; return (name, read fd). The fd is opened read-write and
    non-blocking, so opening it never waits for a writer and writers never see ENXIO.

    Raises:
        OSError: the FIFO cannot be created.
    """
    name = f"{PREFIX}{os.getpid()}-{secrets.token_hex(6)}.wake"
    os.mkfifo(_path(name), 0o600)
    try:
        return name, os.open(_path(name), os.O_RDWR | os.O_NONBLOCK)
    except OSError:
        os.unlink(_path(name))
        raise


def open_fifo(name: str) -> int:
    """Open a peer's wake-up FIFO for writing (non-blocking).

    Raises:
        OSError: ``name`` is not a phalanx name, or the FIFO does not exist here or is not this user's.
    """
    return _open_own(name, os.O_WRONLY | os.O_NONBLOCK, stat.S_ISFIFO)
