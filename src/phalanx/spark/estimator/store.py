"""Where an estimator keeps its run: the intermediate Parquet data, per-epoch checkpoints and logs.

``LocalStore(prefix)`` is a directory every executor sees (a shared mount, or local disk in local mode);
``Store.create(url)`` picks the store for any filesystem fsspec reaches (``file://``, ``hdfs://``,
``s3://``, ``gs://``...); ``HDFSStore`` and ``DBFSLocalStore`` are Horovod's HDFS and Databricks stores.
Everything a run writes lives under ``<prefix>/runs/<run_id>/``::

    data/train/*.parquet   data/val/*.parquet   checkpoints/epoch-0003.pt   logs/history.jsonl

Spark writes the Parquet data through its own filesystem layer (the store's ``spark_url``); the ranks read
it with pyarrow through fsspec.
"""

from __future__ import annotations

import os
import posixpath
import re
import urllib.parse
from typing import Any

from phalanx.errors import InvalidArgumentError

_RUN_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
_CHECKPOINT = re.compile(r"^epoch-(\d{4,})\.pt$")


def check_run_id(run_id: str) -> str:
    """Return ``run_id`` if it is safe as one path component (letters, digits, ``._-``, at most 128).

    Raises:
        InvalidArgumentError: anything else (a ``/`` or ``..`` would leave the store).
    """
    if not isinstance(run_id, str) or not _RUN_ID.match(run_id):
        raise InvalidArgumentError(
            f"run_id={run_id!r} is not a valid run id: use 1-128 letters, digits, '.', '_' or '-', "
            "starting with a letter or digit")
    return run_id


class Store:
    """A place for a run's data, checkpoints and logs, reached through an fsspec filesystem.

    Args:
        prefix_path: the store's root, a URL (``s3://bucket/dir``) or a local path.
        storage_options: passed to fsspec (credentials, endpoints).
    """

    def __init__(self, prefix_path: str, storage_options: dict[str, Any] | None = None) -> None:
        if not isinstance(prefix_path, str) or not prefix_path:
            raise InvalidArgumentError(f"store prefix_path={prefix_path!r}: give a non-empty path or URL")
        self.prefix_path = prefix_path
        self.storage_options = dict(storage_options or {})
        self._fs: Any = None
        self._root = ""

    @staticmethod
    def create(prefix_path: str, *args: Any, **kwargs: Any) -> Store:
        """The store for ``prefix_path`` (Horovod's rule): a :class:`DBFSLocalStore` for a DBFS path
        (``dbfs:/``, ``/dbfs/``), an :class:`HDFSStore` for ``hdfs://``, a :class:`LocalStore` for a path or
        ``file://`` URL, else a :class:`FilesystemStore` (any fsspec protocol)."""
        if DBFSLocalStore.matches_dbfs(prefix_path):
            return DBFSLocalStore(prefix_path, *args, **kwargs)
        if prefix_path.startswith("hdfs://"):
            return HDFSStore(prefix_path, *args, **kwargs)
        if "://" not in prefix_path or prefix_path.startswith("file://"):
            return LocalStore(prefix_path, *args, **kwargs)
        return FilesystemStore(prefix_path, *args, **kwargs)

    # -- the filesystem -------------------------------------------------------------------------------
    @property
    def fs(self) -> Any:
        """The fsspec filesystem (opened on first use, also after unpickling on an executor)."""
        if self._fs is None:
            self._open()
        return self._fs

    def _open(self) -> None:
        try:
            import fsspec
        except ImportError as e:
            raise InvalidArgumentError("the Spark estimators need fsspec: pip install 'phalanx[estimator]'") from e
        self._fs, self._root = fsspec.core.url_to_fs(self.prefix_path, **self.storage_options)

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_fs": None}

    @property
    def root(self) -> str:
        """The prefix as the filesystem names it (no protocol)."""
        if self._fs is None:
            self._open()
        return self._root

    def spark_url(self, path: str) -> str:
        """``path`` (from this store) as Spark's writers name it."""
        protocol = self.prefix_path.split("://", 1)[0]
        return f"{protocol}://{path}" if "://" in self.prefix_path else path

    # -- the layout (Horovod's method names) ----------------------------------------------------------
    def get_runs_path(self) -> str:
        """The directory that holds every run."""
        return posixpath.join(self.root, "runs")

    def get_run_path(self, run_id: str) -> str:
        """The directory of one run."""
        return posixpath.join(self.get_runs_path(), check_run_id(run_id))

    def get_train_data_path(self, run_id: str) -> str:
        """The run's training rows, as Parquet."""
        return posixpath.join(self.get_run_path(run_id), "data", "train")

    def get_val_data_path(self, run_id: str) -> str:
        """The run's validation rows, as Parquet."""
        return posixpath.join(self.get_run_path(run_id), "data", "val")

    def get_checkpoint_path(self, run_id: str) -> str:
        """The directory of the run's per-epoch checkpoints."""
        return posixpath.join(self.get_run_path(run_id), "checkpoints")

    def get_logs_path(self, run_id: str) -> str:
        """The directory of the run's logs (``history.jsonl``: one line of metrics per epoch)."""
        return posixpath.join(self.get_run_path(run_id), "logs")

    def get_checkpoint_filename(self, epoch: int) -> str:
        """The checkpoint file name of an epoch (0-based)."""
        return f"epoch-{epoch:04d}.pt"

    # -- reading and writing --------------------------------------------------------------------------
    def exists(self, path: str) -> bool:
        """Whether ``path`` exists."""
        return bool(self.fs.exists(path))

    def read(self, path: str) -> bytes:
        """The bytes of ``path``."""
        with self.fs.open(path, "rb") as f:
            data: bytes = f.read()
        return data

    def open_read(self, path: str) -> Any:
        """``path`` opened for binary reading (a file object pyarrow can read)."""
        return self.fs.open(path, "rb")

    def write(self, path: str, data: bytes) -> None:
        """Write ``data`` to ``path`` whole: a temporary name, then a rename (local and HDFS: atomic)."""
        self.fs.makedirs(posixpath.dirname(path), exist_ok=True)
        tmp = f"{path}.tmp"
        with self.fs.open(tmp, "wb") as f:
            f.write(data)
        self.fs.mv(tmp, path)

    def append_text(self, path: str, text: str) -> None:
        """Append ``text`` to ``path`` (read and rewritten where the filesystem cannot append)."""
        old = self.read(path) if self.exists(path) else b""
        self.write(path, old + text.encode())

    def last_checkpoint(self, run_id: str) -> tuple[int, str] | None:
        """The latest ``(epoch, path)`` checkpoint of ``run_id``, or None."""
        directory = self.get_checkpoint_path(run_id)
        if not self.exists(directory):
            return None
        found = []
        for entry in self.fs.ls(directory, detail=False):
            match = _CHECKPOINT.match(posixpath.basename(entry))
            if match:
                found.append((int(match.group(1)), posixpath.join(directory, posixpath.basename(entry))))
        return max(found) if found else None

    def remove(self, path: str) -> None:
        """Remove ``path`` (a file or a directory tree) if it exists."""
        if self.exists(path):
            self.fs.rm(path, recursive=True)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.prefix_path!r})"


class FilesystemStore(Store):
    """A store on any fsspec filesystem (``hdfs://``, ``s3://``, ``gs://``, ``abfs://``, ``dbfs:/``...)."""


class LocalStore(Store):
    """A store in a local directory (``/mnt/shared/runs`` or ``file:///...``): in a cluster, every executor
    must see the same directory (a shared mount); in local mode any directory works."""

    def __init__(self, prefix_path: str, storage_options: dict[str, Any] | None = None) -> None:
        path = prefix_path[len("file://"):] if prefix_path.startswith("file://") else prefix_path
        super().__init__(os.path.abspath(path), storage_options)

    def open_read(self, path: str) -> Any:
        """A memory map of ``path``: pyarrow reads it without copies through Python."""
        import pyarrow as pa

        return pa.memory_map(path, "r")

    def spark_url(self, path: str) -> str:
        """A local path as a ``file://`` URL (Spark would otherwise resolve it against HDFS)."""
        return f"file://{path}"


class HDFSStore(FilesystemStore):
    """Horovod's ``HDFSStore``: a store on HDFS through fsspec (pyarrow's ``HadoopFileSystem``, which needs
    the cluster's ``libhdfs`` and Hadoop ``CLASSPATH`` where the ranks run).

    Args:
        prefix_path: ``hdfs://namenode:8020/user/me/runs``, ``hdfs:///user/me/runs`` or ``/user/me/runs``.
        host: the namenode (default: the URL's, else ``"default"``: Hadoop's configured one).
        port: its port (default: the URL's, else 0).
        user: the HDFS user.
        kerb_ticket: a Kerberos ticket cache path.
        driver: Horovod's choice of HDFS driver; accepted (pyarrow has only ``libhdfs``).
        extra_conf: extra Hadoop settings.
        temp_dir: accepted for Horovod compatibility (nothing is staged locally).
        storage_options: further fsspec options.

    Raises:
        InvalidArgumentError: the path is not an HDFS URL or an absolute path.
    """

    def __init__(self, prefix_path: str, host: str | None = None, port: int | None = None, user: str | None = None,
                 kerb_ticket: str | None = None, driver: str = "libhdfs", extra_conf: dict[str, str] | None = None,
                 temp_dir: str | None = None, storage_options: dict[str, Any] | None = None) -> None:
        del driver, temp_dir
        parts = urllib.parse.urlsplit(prefix_path if isinstance(prefix_path, str) else "")
        if parts.scheme not in ("", "hdfs") or not parts.path.startswith("/"):
            raise InvalidArgumentError(
                f"HDFSStore prefix_path={prefix_path!r}: give hdfs://namenode:port/path, hdfs:///path or /path")
        self.url_prefix = f"hdfs://{parts.netloc}"  # what Spark's writers are given, host and port included
        options = {"host": host or parts.hostname or "default", "port": int(port or parts.port or 0), "user": user,
                   "kerb_ticket": kerb_ticket, "extra_conf": extra_conf, **(storage_options or {})}
        super().__init__(f"hdfs://{parts.path}", options)

    def spark_url(self, path: str) -> str:
        """``path`` with the store's ``hdfs://host:port`` (Spark's writers resolve it themselves)."""
        return f"{self.url_prefix}{path}"


class DBFSLocalStore(LocalStore):
    """Horovod's ``DBFSLocalStore``: Databricks' DBFS through its local mount (``/dbfs/...``), which every
    executor of a Databricks cluster sees.

    Args:
        prefix_path: ``dbfs:/path``, ``/dbfs/path``, ``file:/dbfs/path`` or ``file:///dbfs/path``.

    Raises:
        InvalidArgumentError: any other path.
    """

    def __init__(self, prefix_path: str, storage_options: dict[str, Any] | None = None) -> None:
        super().__init__(self.normalize_path(prefix_path), storage_options)

    @staticmethod
    def matches_dbfs(path: str) -> bool:
        """Whether ``path`` is one of DBFS's spellings."""
        return ((path.startswith("dbfs:/") and not path.startswith("dbfs://")) or path.startswith("/dbfs/")
                or path.startswith("file:///dbfs/") or path.startswith("file:/dbfs/"))

    @staticmethod
    def normalize_path(path: str) -> str:
        """``path`` as the local mount's ``/dbfs/...``.

        Raises:
            InvalidArgumentError: ``path`` is not a DBFS path.
        """
        if not isinstance(path, str) or not DBFSLocalStore.matches_dbfs(path):
            raise InvalidArgumentError(
                f"DBFSLocalStore prefix_path={path!r} is not a DBFS path: give dbfs:/..., /dbfs/..., "
                "file:/dbfs/... or file:///dbfs/...")
        if path.startswith("dbfs:/"):
            return "/dbfs" + path[len("dbfs:"):]
        if path.startswith("file:///"):
            return path[len("file://"):]
        if path.startswith("file:/"):
            return path[len("file:"):]
        return path
