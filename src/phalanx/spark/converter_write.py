"""Writing a converter's DataFrame as Parquet: Spark's own writer, or the executors through fsspec.

Spark writes the cache wherever its Hadoop filesystems reach (local paths, ``hdfs://``, ``s3a://`` with the
hadoop-aws jars, ``dbfs:/``...). Where it has no filesystem for the URL's scheme (``s3://``, ``gs://``,
``az://``... on a cluster without the connector's jars), each executor writes its partitions through fsspec
and pyarrow instead (``DataFrame.mapInArrow``, so classic Spark and Spark Connect alike): partition ``i`` becomes
``part-0000i.parquet``, in row groups of about ``row_group_bytes``. The name depends only on the partition,
so a retried or speculative task replaces its own file and never adds a second one, and a failed attempt
discards its upload (an object store shows a file whole or not at all). Once every task has returned, the
driver writes ``_SUCCESS``, as Spark's committer does.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterator
from typing import Any

from phalanx.errors import InvalidArgumentError

log = logging.getLogger("phalanx")

#: Spark's codec names -> pyarrow's (Parquet has no bzip2 or deflate codec).
ARROW_CODECS = {"uncompressed": "none", "snappy": "snappy", "gzip": "gzip", "lz4": "lz4", "zstd": "zstd"}
SUCCESS = "_SUCCESS"
#: What Hadoop says when it has no filesystem for a URL's scheme, or the class of the one configured is missing.
_NO_FILESYSTEM = ("UnsupportedFileSystemException", "No FileSystem for scheme", "ClassNotFoundException: Class org.")


def write_parquet(df: Any, url: str, row_group_bytes: int, codec: str, storage_options: dict[str, Any]) -> None:
    """``df`` as Parquet files in the new directory ``url`` (the module docstring).

    Raises:
        InvalidArgumentError: the executors must write and pyarrow has no such codec.
    """
    try:
        df.write.option("compression", codec).option("parquet.block.size", row_group_bytes).parquet(url)
        return
    except Exception as e:  # only "no filesystem for this scheme" falls through to fsspec
        if not any(text in str(e) for text in _NO_FILESYSTEM):
            raise
        log.info("phalanx converter: Spark has no filesystem for %s (%s); the executors write through fsspec",
                 url, str(e).splitlines()[0][:200])
    write_through_fsspec(df, url, row_group_bytes, codec, storage_options)


def write_through_fsspec(df: Any, url: str, row_group_bytes: int, codec: str,
                         storage_options: dict[str, Any]) -> None:
    """Each partition of ``df`` written by its executor to ``url`` through fsspec, then ``_SUCCESS``."""
    import fsspec

    if codec not in ARROW_CODECS:
        raise InvalidArgumentError(
            f"compression_codec={codec!r} cannot be written to {url} by the executors through fsspec (Spark has no "
            f"filesystem for it here); give one of {sorted(ARROW_CODECS)}")
    written = df.mapInArrow(partition_writer(url, row_group_bytes, ARROW_CODECS[codec], storage_options),
                            "path string, rows long").collect()
    fs, root = fsspec.core.url_to_fs(url, **storage_options)
    fs.pipe_file(f"{root.rstrip('/')}/{SUCCESS}", b"")
    log.info("phalanx converter: the executors wrote %d file(s), %d rows, to %s", len(written),
             sum(int(r["rows"]) for r in written), url)


def partition_writer(url: str, row_group_bytes: int, compression: str,
                     storage_options: dict[str, Any]) -> Callable[[Iterator[Any]], Iterator[Any]]:
    """The function ``mapInArrow`` runs on each partition: its batches to ``url/part-NNNNN.parquet``; yields
    one ``(path, rows)`` record (none for an empty partition, which writes no file)."""

    def write(batches: Iterator[Any]) -> Iterator[Any]:
        import pyarrow as pa
        from pyspark import TaskContext

        context = TaskContext.get()
        index = context.partitionId() if context is not None else 0
        path = f"{url.rstrip('/')}/part-{index:05d}.parquet"
        rows = _write_batches(batches, path, row_group_bytes, compression, storage_options)
        if rows:
            yield pa.RecordBatch.from_pydict({"path": [path], "rows": [rows]})

    return write


def _write_batches(batches: Iterator[Any], path: str, row_group_bytes: int, compression: str,
                   storage_options: dict[str, Any]) -> int:
    """The non-empty ``batches`` in one Parquet file at ``path``, row groups of about ``row_group_bytes``;
    the rows written. The file is committed only when every batch is in; on an error its upload is dropped."""
    part = _PartFile(path, compression, storage_options)
    try:
        for batch in batches:
            while batch.num_rows:  # a batch larger than a row group's room is cut where the room ends
                room = max(1, math.ceil((row_group_bytes - part.pending_bytes) * batch.num_rows / max(1, batch.nbytes)))
                part.add(batch.slice(0, room))
                batch = batch.slice(room)
                if part.pending_bytes >= row_group_bytes:
                    part.flush()
        part.commit()
    except BaseException:
        part.discard()
        raise
    return part.rows


class _PartFile:
    """One partition's Parquet file, opened at its first batch; batches wait in memory for their row group."""

    def __init__(self, path: str, compression: str, storage_options: dict[str, Any]) -> None:
        self.path, self.compression, self.storage_options = path, compression, storage_options
        self.handle: Any = None
        self.writer: Any = None
        self.pending: list[Any] = []
        self.rows = self.pending_bytes = 0

    def add(self, batch: Any) -> None:
        if self.writer is None:
            import fsspec
            import pyarrow.parquet as pq

            self.handle = fsspec.open(self.path, "wb", **self.storage_options).open()
            self.writer = pq.ParquetWriter(self.handle, batch.schema, compression=self.compression)
        self.pending.append(batch)
        self.rows, self.pending_bytes = self.rows + batch.num_rows, self.pending_bytes + batch.nbytes

    def flush(self) -> None:
        """The waiting batches as one row group."""
        import pyarrow as pa

        if self.pending:
            table = pa.Table.from_batches(self.pending)
            self.writer.write_table(table, row_group_size=table.num_rows)
            self.pending, self.pending_bytes = [], 0

    def commit(self) -> None:
        """The rest written, the file closed: an object store's upload becomes visible here."""
        if self.writer is not None:
            self.flush()
            self.writer.close()
            self.handle.close()

    def discard(self) -> None:
        """Drop an unfinished upload (fsspec's buffered files can; a local file is closed as it is)."""
        if self.handle is None:
            return
        discard = getattr(self.handle, "discard", None)
        if callable(discard):
            discard()
        else:
            self.handle.close()
