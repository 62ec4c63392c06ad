"""``make_spark_converter``: Petastorm's Spark converter, a DataFrame as every rank's DataLoader or tf.data.

On the driver, ``make_spark_converter(df)`` converts the columns Petastorm converts (Spark ML vectors to
arrays; with ``dtype='float32'`` doubles to floats), refuses a column no loader can take (by name), and has
Spark write the DataFrame once as Parquet under the cache directory (the Spark conf
``petastorm.spark.converter.parentCacheDirUrl``, or ``phalanx.spark.converter.parentCacheDirUrl``; where Spark
has no filesystem for its scheme, the executors write it through fsspec: ``phalanx.spark.converter_write``). The same
plan with the same options is written once per driver process: later converters reuse the directory until
``delete()`` (or the driver's exit) removes it. The converter is small and picklable: it carries the Parquet
row groups, not the DataFrame, to the ranks, where ``make_torch_dataloader`` / ``make_tf_dataset`` read them
with pyarrow (``phalanx.spark.loader``; no Petastorm needed).
"""

from __future__ import annotations

import atexit
import datetime
import logging
import posixpath
import threading
import uuid
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from phalanx.errors import InvalidArgumentError
from phalanx.spark.loader import DataLoader, Reader
from phalanx.spark.shards import Piece

log = logging.getLogger("phalanx")

PARENT_CACHE_DIR_URL_CONF = "petastorm.spark.converter.parentCacheDirUrl"
PHALANX_CACHE_DIR_URL_CONF = "phalanx.spark.converter.parentCacheDirUrl"
DEFAULT_ROW_GROUP_SIZE_BYTES = 32 * 1024 * 1024
CODECS = ("uncompressed", "bzip2", "gzip", "lz4", "snappy", "deflate", "zstd")
#: make_batch_reader arguments that tune Petastorm's worker pools; phalanx reads in the training process.
POOL_ARGS = frozenset({"reader_pool_type", "results_queue_size", "pyarrow_serialize", "zmq_copy_buffers",
                       "hdfs_driver", "cache_type", "cache_location", "cache_size_limit",
                       "cache_row_size_estimate", "cache_extra_settings", "infer_schema_from_first_row"})
READER_ARGS = frozenset({"cur_shard", "shard_count", "shuffle_row_groups", "seed", "shard_seed", "schema_fields",
                         "transform_spec", "storage_options"})


class SparkDatasetConverter:
    """One materialised DataFrame (Petastorm's class): ``len()`` rows, loaders on any rank, ``delete()``.

    Attributes:
        cache_dir_url: where the Parquet data is.
        file_urls: its Parquet files.
        dataset_size: its row count.
        pieces: its row groups (what the ranks share out).
    """

    PARENT_CACHE_DIR_URL_CONF = PARENT_CACHE_DIR_URL_CONF

    def __init__(self, cache_dir_url: str, file_urls: Sequence[str], dataset_size: int,
                 pieces: Sequence[Piece] = (), storage_options: dict[str, Any] | None = None) -> None:
        self.cache_dir_url, self.file_urls, self.dataset_size = cache_dir_url, list(file_urls), int(dataset_size)
        self.pieces = tuple(pieces)
        self.storage_options = dict(storage_options or {})

    def __len__(self) -> int:
        return self.dataset_size

    def make_torch_dataloader(self, batch_size: int = 32, num_epochs: int | None = None,
                              workers_count: int | None = None, shuffling_queue_capacity: int = 0,
                              data_loader_fn: Callable[..., Any] | None = None,
                              **petastorm_reader_kwargs: Any) -> Any:
        """A context manager giving a loader of dicts of tensors (Petastorm's signature).

        Args:
            batch_size: rows per batch.
            num_epochs: passes over the data; None (the default): without end.
            workers_count: accepted for Petastorm's signature (phalanx reads in the training process).
            shuffling_queue_capacity: above 0, shuffle rows within each row group (seeded, see
                ``phalanx.spark.loader``); row groups are shuffled unless ``shuffle_row_groups=False``.
            data_loader_fn: called as ``data_loader_fn(reader=, batch_size=, shuffling_queue_capacity=)``
                instead of ``phalanx.spark.loader.DataLoader``.
            **petastorm_reader_kwargs: ``cur_shard``, ``shard_count`` (``hvd.rank()``, ``hvd.size()``),
                ``shuffle_row_groups`` (True), ``seed`` (0; the same on every rank), ``schema_fields``,
                ``transform_spec``, ``storage_options``; Petastorm's pool arguments are accepted and ignored.

        Raises:
            InvalidArgumentError: an argument phalanx does not take (named), or a bad value.
        """
        reader = self._reader(num_epochs, petastorm_reader_kwargs)
        make = data_loader_fn or DataLoader
        return _closing(reader, lambda: make(reader=reader, batch_size=batch_size,
                                             shuffling_queue_capacity=shuffling_queue_capacity))

    def make_tf_dataset(self, batch_size: int | None = None, prefetch: int | None = None,
                        num_epochs: int | None = None, workers_count: int | None = None,
                        shuffling_queue_capacity: int | None = None, **petastorm_reader_kwargs: Any) -> Any:
        """A context manager giving a ``tf.data.Dataset`` of batches (Petastorm's signature): each element is
        a named tuple of the columns, ``batch_size`` (default 32) rows, prefetched (``prefetch``; None:
        AUTOTUNE). The other arguments are :meth:`make_torch_dataloader`'s.
        """
        from phalanx.spark.tf_dataset import make_dataset

        reader = self._reader(num_epochs, petastorm_reader_kwargs)
        loader = DataLoader(reader, batch_size or 32, shuffling_queue_capacity or 0, collate_fn=lambda b: b)
        return _closing(reader, lambda: make_dataset(loader, prefetch))

    def _reader(self, num_epochs: int | None, kwargs: dict[str, Any]) -> Reader:
        unknown = sorted(set(kwargs) - READER_ARGS - POOL_ARGS)
        if unknown:
            raise InvalidArgumentError(
                f"make_torch_dataloader / make_tf_dataset got {unknown}, which phalanx's reader does not take "
                f"(it takes {sorted(READER_ARGS)}); filter or select the DataFrame before make_spark_converter")
        args = {k: v for k, v in kwargs.items() if k in READER_ARGS and k != "shard_seed"}
        args.setdefault("storage_options", self.storage_options)
        _warn_if_not_horovod_shard(args.get("cur_shard"), args.get("shard_count"))
        return Reader(self.cache_dir_url, self.pieces, num_epochs=num_epochs, **args)

    def delete(self) -> None:
        """Delete the cached Parquet data (and forget it, so the next converter of the plan writes it again)."""
        _forget(self.cache_dir_url)
        _delete_dir(self.cache_dir_url, self.storage_options)


@contextmanager
def _closing(reader: Reader, make: Callable[[], Any]) -> Iterator[Any]:
    try:
        yield make()
    finally:
        reader.stop()
        reader.join()


def _warn_if_not_horovod_shard(cur_shard: int | None, shard_count: int | None) -> None:
    import os

    rank, size = os.environ.get("HOROVOD_RANK"), os.environ.get("HOROVOD_SIZE")
    if rank is not None and size is not None and (cur_shard, shard_count) != (int(rank), int(size)):
        log.warning("cur_shard=%s and shard_count=%s differ from this rank's hvd.rank()=%s and hvd.size()=%s; "
                    "give cur_shard=hvd.rank(), shard_count=hvd.size() for each rank to read its own share",
                    cur_shard, shard_count, rank, size)


# -- the cache ------------------------------------------------------------------------------------------
@dataclass
class _Cached:
    df: Any
    options: tuple[Any, ...]
    url: str


_cache: list[_Cached] = []
_cache_lock = threading.Lock()
_deleted: set[str] = set()  # by delete(): nothing left for the exit's clean-up


def _forget(url: str) -> None:
    with _cache_lock:
        _cache[:] = [c for c in _cache if c.url != url]
        _deleted.add(url)


def _cached_url(df: Any, options: tuple[Any, ...]) -> str | None:
    for entry in _cache:
        if entry.options == options and _same_plan(entry.df, df):
            return entry.url
    return None


def _same_plan(a: Any, b: Any) -> bool:
    try:
        return bool(a.semanticHash() == b.semanticHash() and a.sameSemantics(b))
    except Exception:  # another session's plan, or one Spark cannot compare: not the same
        return False


def _delete_dir(url: str, storage_options: dict[str, Any]) -> None:
    import fsspec

    fs, path = fsspec.core.url_to_fs(url, **storage_options)
    if fs.exists(path):
        fs.rm(path, recursive=True)


def _delete_at_exit(url: str, storage_options: dict[str, Any]) -> None:
    if url in _deleted:
        return
    try:
        _delete_dir(url, storage_options)
    except Exception as e:  # best effort at exit, as Petastorm's; the reason is logged
        log.warning("could not delete the converter cache %s: %r", url, e)


# -- the driver's side ----------------------------------------------------------------------------------
def parent_cache_dir_url(spark: Any) -> str:
    """The cache directory from the Spark conf, as a URL (a plain path becomes ``file://``).

    Raises:
        InvalidArgumentError: neither conf is set.
    """
    url = spark.conf.get(PARENT_CACHE_DIR_URL_CONF, None) or spark.conf.get(PHALANX_CACHE_DIR_URL_CONF, None)
    if not url:
        raise InvalidArgumentError(
            f"set the Spark conf {PARENT_CACHE_DIR_URL_CONF} (or {PHALANX_CACHE_DIR_URL_CONF}) to a directory "
            "every executor and rank can reach (file:///shared/dir, s3://bucket/dir, ...), e.g. "
            f"spark.conf.set('{PARENT_CACHE_DIR_URL_CONF}', 'file:///tmp/converter')")
    if "://" not in url:
        url = "file://" + posixpath.abspath(url)
    return url.rstrip("/")


def make_spark_converter(df: Any, parquet_row_group_size_bytes: int = DEFAULT_ROW_GROUP_SIZE_BYTES,
                         compression_codec: str | None = None, dtype: str | None = "float32",
                         storage_options: dict[str, Any] | None = None) -> SparkDatasetConverter:
    """Materialise ``df`` as Parquet in the cache directory (once per plan) and return its converter.

    Args:
        df: the DataFrame (classic or Spark Connect).
        parquet_row_group_size_bytes: Parquet row-group size (default 32 MiB).
        compression_codec: one of :data:`CODECS`; None: uncompressed.
        dtype: ``'float32'`` (default: doubles and vectors become float32), ``'float64'`` (floats become
            float64), or None (types kept; vectors become float64 arrays).
        storage_options: fsspec options for the cache (credentials, endpoint): for the ranks that read it, and
            for the executors that write it where Spark has no filesystem for its scheme (``s3://`` without
            hadoop-aws: ``phalanx.spark.converter_write``); phalanx's addition.

    Raises:
        InvalidArgumentError: no cache directory configured, an unknown codec or dtype, or a column whose
            type no loader can take (named, with the fix).
    """
    from phalanx.spark import converter_schema

    codec = (compression_codec or "uncompressed").lower()
    if codec not in CODECS:
        raise InvalidArgumentError(f"compression_codec={compression_codec!r}: give None or one of {list(CODECS)}")
    if dtype not in (None, "float32", "float64"):
        raise InvalidArgumentError(f"dtype={dtype!r}: give 'float32', 'float64' or None")
    converter_schema.check_columns(df)
    parent = parent_cache_dir_url(df.sparkSession)
    options = (parent, int(parquet_row_group_size_bytes), codec, dtype)
    with _cache_lock:
        url = _cached_url(df, options)
        if url is None:
            url = _materialize(converter_schema.converted(df, dtype), parent, int(parquet_row_group_size_bytes),
                               codec, dict(storage_options or {}))
            _cache.append(_Cached(df, options, url))
            atexit.register(_delete_at_exit, url, dict(storage_options or {}))
    pieces = list_pieces(url, storage_options or {})
    return SparkDatasetConverter(url, sorted({p.path for p in pieces}), sum(p.rows for p in pieces), pieces,
                                 storage_options)


def _materialize(df: Any, parent: str, row_group_bytes: int, codec: str, storage_options: dict[str, Any]) -> str:
    from phalanx.spark.converter_write import write_parquet

    stamp = datetime.datetime.now().strftime("%Y%m%d%H%M%S")
    url = f"{parent}/{stamp}-appid-{_app_id(df.sparkSession)}-{uuid.uuid4()}"
    write_parquet(df, url, row_group_bytes, codec, storage_options)
    log.info("phalanx converter: materialised the DataFrame at %s", url)
    return url


def _app_id(spark: Any) -> str:
    try:
        return str(spark.sparkContext.applicationId)
    except Exception:  # Spark Connect has no SparkContext on the client
        return str(spark.conf.get("spark.app.id", "connect"))


def list_pieces(url: str, storage_options: dict[str, Any]) -> list[Piece]:
    """Every non-empty row group of the Parquet files under ``url``, in file-name order."""
    import fsspec

    fs, root = fsspec.core.url_to_fs(url, **storage_options)
    return pieces_of(fs, root)


def pieces_of(fs: Any, root: str) -> list[Piece]:
    """Every non-empty row group of the Parquet files in directory ``root`` of fsspec filesystem ``fs``."""
    import pyarrow.parquet as pq

    pieces: list[Piece] = []
    for path in sorted(str(p) for p in fs.ls(root, detail=False) if str(p).endswith(".parquet")):
        with fs.open(path, "rb") as f:
            meta = pq.ParquetFile(f).metadata
        pieces += [Piece(path, g, meta.row_group(g).num_rows) for g in range(meta.num_row_groups)
                   if meta.row_group(g).num_rows > 0]
    return pieces
