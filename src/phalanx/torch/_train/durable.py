"""Writing a small file whole, durably, on a local disk or any fsspec URL (shared by the elastic commits
and the checkpoints' completion markers).

Locally: a temporary file next to the target, flushed to the disk, renamed over the target, the directory
flushed too, so a reader never sees half a file and the rename survives a crash of the machine. On an
object store (``s3://``, ``gs://``...) one PUT, which the store makes visible whole or not at all.
"""

from __future__ import annotations

import os
import posixpath
from pathlib import Path
from typing import Any

from phalanx.env import files


def is_url(target: str) -> bool:
    """Whether ``target`` names a filesystem other than the local one (``file://`` counts as local)."""
    return "://" in target and not target.startswith("file://")


def local_path(target: str) -> str:
    """``target`` without a ``file://`` prefix."""
    return target[len("file://"):] if target.startswith("file://") else target


def fsync_dir(folder: str) -> None:
    """Flush a directory's entries (a rename in it) to the disk."""
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_local(path: str, data: bytes) -> None:
    """``data`` at local ``path``, whole and flushed (the module docstring). The temporary file has a random
    name, is created exclusively and never through a link (``env.files.create_temporary``)."""
    folder = Path(os.path.dirname(path) or ".")
    folder.mkdir(parents=True, exist_ok=True)
    tmp: Path | None = None
    try:
        fd, tmp = files.create_temporary(folder, os.path.basename(path))
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if tmp is not None:
            tmp.unlink(missing_ok=True)
        raise
    fsync_dir(str(folder))


def write_whole(target: str, data: bytes, storage_options: dict[str, Any] | None = None) -> None:
    """``data`` at ``target`` (a path or an fsspec URL), whole (the module docstring)."""
    if not is_url(target):
        write_local(local_path(target), data)
        return
    import fsspec

    fs, path = fsspec.core.url_to_fs(target, **(storage_options or {}))
    fs.makedirs(posixpath.dirname(path), exist_ok=True)
    fs.pipe_file(path, data)


def read_bytes(target: str, storage_options: dict[str, Any] | None = None) -> bytes | None:
    """The bytes at ``target``, or None when there is no such file."""
    if not is_url(target):
        try:
            with open(local_path(target), "rb") as f:
                return f.read()
        except FileNotFoundError:
            return None
    import fsspec

    fs, path = fsspec.core.url_to_fs(target, **(storage_options or {}))
    return bytes(fs.cat_file(path)) if fs.exists(path) else None
