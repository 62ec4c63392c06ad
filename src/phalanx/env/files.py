"""Creating the files a job writes where other users can write too, without following what they planted.

Logs (``--output-filename``), timelines (``--timeline-filename``) and the elastic checkpoint often go to
shared directories such as ``/tmp``. Another user may have planted a symlink there (the job would append
to whatever it points at), a FIFO (an ``open`` for writing blocks for good) or a directory of their own (they
can swap its entries at will). So every file is opened relative to a directory descriptor, with
``O_NOFOLLOW`` (a link is refused, not followed) and ``O_NONBLOCK`` (a FIFO cannot block the open), and is
kept only if it is a regular file of this user with one link; directories must be this user's; new files
and directories are private (0600 / 0700); temporary names are random and created with ``O_EXCL``.
"""

from __future__ import annotations

import errno
import fcntl
import os
import secrets
import stat
from pathlib import Path

from phalanx.errors import InvalidArgumentError

FILE_MODE = 0o600
DIR_MODE = 0o700
_OPEN = os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


class UnsafePathError(InvalidArgumentError, OSError):
    """A path another user could redirect: a link, a FIFO, or a file or directory that is not this user's."""


def _refuse(what: str, path: Path | str, why: str, setting: str) -> UnsafePathError:
    return UnsafePathError(f"{setting} {path}: {what} {why}; refusing to write there (another user could "
                           f"redirect the writes). Choose a directory of your own")


def open_dir(path: Path | str, setting: str, create: bool = True) -> int:
    """A descriptor of directory ``path`` (created 0700 with its parents when missing and ``create``).

    Raises:
        UnsafePathError: ``path`` is not a directory or belongs to another user (``setting``, e.g.
            ``--output-filename``, is named in the message).
        OSError: it cannot be created or opened.
    """
    if create:
        os.makedirs(path, mode=DIR_MODE, exist_ok=True)
    return _owned_dir(os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC), path, setting)


def subdir(parent_fd: int, name: str, setting: str) -> int:
    """A descriptor of ``name`` in ``parent_fd``: made 0700 if missing, refused if a link or not ours."""
    try:
        os.mkdir(name, DIR_MODE, dir_fd=parent_fd)
    except FileExistsError:
        pass
    try:
        fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | _OPEN, dir_fd=parent_fd)
    except OSError as e:  # ELOOP: a link; ENOTDIR: something else planted under that name
        raise _refuse("the entry", name, f"is not a directory ({e.strerror})", setting) from e
    return _owned_dir(fd, name, setting)


def _owned_dir(fd: int, path: Path | str, setting: str) -> int:
    """``fd`` when the directory it opens is this user's; else it is closed and refused."""
    try:
        _check_owner(os.fstat(fd), path, "the directory", setting)
    except BaseException:
        os.close(fd)
        raise
    return fd


def open_file(dir_fd: int, name: str, setting: str, append: bool = True) -> int:
    """A blocking write descriptor of regular file ``name`` in ``dir_fd`` (created 0600; appended to, or
    truncated when not ``append``).

    Raises:
        UnsafePathError: ``name`` is a link, a FIFO or anything but a regular file of this user with one
            link.
        OSError: it cannot be opened.
    """
    flags = os.O_WRONLY | os.O_CREAT | _OPEN | (os.O_APPEND if append else 0)
    try:
        fd = os.open(name, flags, FILE_MODE, dir_fd=dir_fd)
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.ENXIO):  # a link; a FIFO nobody reads
            raise _refuse("the file", name, f"is a link or a FIFO ({e.strerror})", setting) from e
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_nlink != 1:
            raise _refuse("the file", name, "is not a regular file with one link", setting)
        _check_owner(st, name, "the file", setting)
        if not append:
            os.ftruncate(fd, 0)
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_NONBLOCK)
    except BaseException:
        os.close(fd)
        raise
    return fd


def open_path(path: Path | str, setting: str, append: bool = False) -> int:
    """:func:`open_file` of ``path`` in its (existing) directory; the directory may be shared (``/tmp``)."""
    folder, name = os.path.split(os.path.abspath(path))
    dir_fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        return open_file(dir_fd, name, setting, append)
    finally:
        os.close(dir_fd)


def create_temporary(folder: Path, name: str) -> tuple[int, Path]:
    """A new private file next to where ``name`` will go in ``folder``: a random name, ``O_EXCL`` (never an
    existing file or a link). Returns its descriptor and path."""
    while True:
        tmp = folder / f".{name}.{secrets.token_hex(8)}.tmp"
        try:
            flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
            return os.open(tmp, flags, FILE_MODE), tmp
        except FileExistsError:
            continue


def _check_owner(st: os.stat_result, path: Path | str, what: str, setting: str) -> None:
    if st.st_uid != os.geteuid():
        raise _refuse(what, path, f"belongs to uid {st.st_uid}, not to this user (uid {os.geteuid()})", setting)
