"""A rank's batches of a converter's Parquet data: Petastorm's reader and PyTorch ``DataLoader`` roles.

``Reader`` holds what Petastorm's ``make_batch_reader`` takes (shard, epochs, seed, columns, transform) and
reads runs of row groups with pyarrow through fsspec. ``DataLoader(reader, batch_size,
shuffling_queue_capacity)`` has Petastorm's ``petastorm.pytorch.DataLoader`` signature and yields dicts
``{column: tensor}`` (strings and bytes as lists), following ``phalanx.spark.shards``: every rank takes the
same number of steps each epoch, and every row is read exactly once per epoch across the ranks.

Its position (epoch and steps taken) is :meth:`DataLoader.state_dict`; ``hvd.elastic.TorchState(...,
loader=loader)`` keeps it in the elastic state, so after a reset the loader continues where the last commit
was, re-split over the new world. Rows are shuffled within each row group (``shuffling_queue_capacity >
0``) by a permutation drawn from ``(seed, epoch, group)``, never by a buffer whose contents a commit would
have to hold.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np

from phalanx.errors import InvalidArgumentError, UsageError
from phalanx.spark import shards
from phalanx.spark.shards import Piece, Run

log = logging.getLogger("phalanx")
Batch = dict[str, np.ndarray]
#: About how many bytes of a row group a rank decodes at a time when it reads the rows in file order: small
#: enough that the decoder's buffers are reused from chunk to chunk, large enough that the per-chunk work in
#: Python is spread over many batches.
CHUNK_BYTES = 1 << 20


def column_array(name: str, column: Any) -> np.ndarray:
    """A pyarrow column as NumPy: numbers ``(rows,)``, fixed-size lists ``(rows, size)``, strings and bytes
    as an object array.

    Raises:
        UsageError: nulls in a numeric column, lists of different lengths, or another type; the column named.
    """
    import pyarrow as pa

    if isinstance(column, pa.ChunkedArray):  # one chunk (a row group) is used as is: combining copies it
        column = column.chunk(0) if column.num_chunks == 1 else column.combine_chunks()
    kind = column.type
    if pa.types.is_string(kind) or pa.types.is_large_string(kind) or pa.types.is_binary(kind) \
            or pa.types.is_large_binary(kind):
        return np.asarray(column.to_numpy(zero_copy_only=False), dtype=object)
    if column.null_count:
        raise UsageError(f"column {name!r} has {column.null_count} null value(s); fill them before converting "
                         "(df.fillna / df.dropna) or handle them in a transform_spec")
    if pa.types.is_list(kind) or pa.types.is_large_list(kind) or pa.types.is_fixed_size_list(kind):
        return _list_array(name, column)
    if pa.types.is_integer(kind) or pa.types.is_floating(kind) or pa.types.is_boolean(kind):
        return np.asarray(column.to_numpy(zero_copy_only=False))
    raise UsageError(f"column {name!r} has type {kind}, which the loader cannot turn into a tensor; cast or "
                     "drop it in the DataFrame, or turn it into numbers in a transform_spec")


def _list_array(name: str, column: Any) -> np.ndarray:
    values = column.flatten()
    if values.null_count:
        raise UsageError(f"column {name!r} has null elements in its arrays; fill them before converting")
    rows = len(column)
    lengths = np.diff(np.asarray(column.offsets)) if hasattr(column, "offsets") else None
    if lengths is not None and rows and (lengths.min() != lengths.max()):
        raise UsageError(f"column {name!r} has arrays of different lengths ({lengths.min()} to {lengths.max()}); "
                         "every row of an array column must have one length (pad it, or use a transform_spec)")
    width = len(values) // rows if rows else 0
    return np.asarray(values.to_numpy(zero_copy_only=False)).reshape(rows, width)


def frame_batch(frame: Any) -> Batch:
    """A pandas DataFrame (a transform's output) as a batch: arrays in object columns stacked."""
    batch: Batch = {}
    for name in frame.columns:
        values = frame[name].to_numpy()
        if values.dtype == object and len(values) and isinstance(values[0], np.ndarray):
            values = np.stack(values)
        batch[str(name)] = values
    return batch


class Reader:
    """One rank's view of a converter's data: which rows, in which order, and how to read them.

    Args:
        url: the data's directory URL (fsspec: a local path, ``file://``, ``s3://``...).
        pieces: every row group of the data, the same list on every rank.
        cur_shard, shard_count: this rank and the number of ranks (None, None: one shard).
        num_epochs: passes over the data; None: without end.
        shuffle_row_groups: visit the row groups in a seeded order each epoch.
        seed: the seed of every shuffle (the same on every rank).
        schema_fields: the columns to read (None: all).
        transform_spec: a :class:`phalanx.spark.transform.TransformSpec` applied to each read stretch.
        storage_options: fsspec options (credentials, endpoint).
    """

    def __init__(self, url: str, pieces: Sequence[Piece], cur_shard: int | None = None,
                 shard_count: int | None = None, num_epochs: int | None = 1, shuffle_row_groups: bool = True,
                 seed: int = 0, schema_fields: Sequence[str] | None = None, transform_spec: Any = None,
                 storage_options: dict[str, Any] | None = None) -> None:
        self.url, self.pieces = url, tuple(pieces)
        self.cur_shard, self.shard_count = _check_shard(cur_shard, shard_count)
        if num_epochs is not None and (isinstance(num_epochs, bool) or int(num_epochs) < 1):
            raise InvalidArgumentError(f"num_epochs={num_epochs!r}: give a positive int, or None for no end")
        self.num_epochs = None if num_epochs is None else int(num_epochs)
        self.shuffle_row_groups, self.seed = bool(shuffle_row_groups), int(seed)
        self.columns = None if schema_fields is None else [str(f) for f in schema_fields]
        self.transform_spec = transform_spec
        self.storage_options = dict(storage_options or {})
        self._fs: Any = None
        self._files: dict[str, Any] = {}

    @property
    def rows(self) -> list[int]:
        """Each row group's row count."""
        return [p.rows for p in self.pieces]

    def order(self, epoch: int) -> list[Run]:
        """The epoch's runs (``phalanx.spark.shards.epoch_order``)."""
        return shards.epoch_order(self.rows, self.seed, epoch, self.shuffle_row_groups)

    def read(self, run: Run, epoch: int, shuffle_rows: bool) -> Batch:
        """The rows of ``run`` (in the group's seeded permutation when ``shuffle_rows``)."""
        index, lo, hi = run
        table = self._table(self.pieces[index])
        positions = None
        if shuffle_rows:
            positions = np.random.default_rng([self.seed, epoch, index]).permutation(self.pieces[index].rows)[lo:hi]
        if self.transform_spec is not None:
            table = table.slice(lo, hi - lo) if positions is None else table.take(positions)
            return frame_batch(self.transform_spec.apply(table.to_pandas()))
        if positions is None:
            table = table.slice(lo, hi - lo)
        # np.take copies once into writable memory, several times faster than fancy indexing (Arrow's take,
        # then a copy, costs twice)
        return {name: column_array(name, table.column(name)) if positions is None
                else np.take(column_array(name, table.column(name)), positions, axis=0)
                for name in table.column_names}

    def chunks(self, run: Run, epoch: int, shuffle_rows: bool, batch_size: int) -> Iterator[Batch]:
        """The rows of ``run`` in the order :meth:`read` gives them, in one or more chunks.

        Rows read in file order without a transform are decoded about :data:`CHUNK_BYTES` at a time (a
        multiple of ``batch_size`` rows). A whole group decoded at once needs fresh multi-megabyte buffers,
        which in a new process the kernel zeroes page by page for many groups before the allocator reuses
        them, and a rank's memory would grow with the row-group size. Shuffled rows need the whole group.
        """
        if shuffle_rows or self.transform_spec is not None:
            yield self.read(run, epoch, shuffle_rows)
            return
        index, lo, hi = run
        piece = self.pieces[index]
        handle = self._file(piece)
        batches = handle.iter_batches(batch_size=_chunk_rows(handle.metadata.row_group(piece.row_group), batch_size),
                                      row_groups=[piece.row_group], columns=self.columns)
        skip, left = lo, hi - lo
        try:
            for part in batches:
                if skip >= part.num_rows:
                    skip -= part.num_rows
                    continue
                part, skip = part.slice(skip, left), 0
                yield {name: column_array(name, part.column(name)) for name in part.schema.names}
                left -= part.num_rows
                if not left:
                    break
        finally:
            batches.close()

    def empty(self) -> Batch:
        """A batch of no rows with every column (for a rank without rows in a step)."""
        first = self.read((0, 0, min(1, self.pieces[0].rows)), 0, False)  # one row: an array's width
        return {name: values[:0] for name, values in first.items()}

    def _table(self, piece: Piece) -> Any:
        return self._file(piece).read_row_group(piece.row_group, columns=self.columns)

    def _file(self, piece: Piece) -> Any:
        import pyarrow.parquet as pq

        handle = self._files.get(piece.path)
        if handle is None:
            handle = self._files[piece.path] = pq.ParquetFile(self._open(piece.path))
        return handle

    def _open(self, path: str) -> Any:
        if self._fs is None:
            import fsspec

            self._fs = fsspec.core.url_to_fs(self.url, **self.storage_options)[0]
        if getattr(self._fs, "protocol", None) in ("file", ("file", "local")):
            return path  # pyarrow's own reader: faster than a memory map or a Python file object
        return self._fs.open(path, "rb")

    def stop(self) -> None:
        """Close the files (Petastorm's ``Reader.stop``)."""
        for handle in self._files.values():
            handle.close()
        self._files.clear()

    def join(self) -> None:
        """Petastorm's ``Reader.join``: nothing runs in the background, so nothing to wait for."""

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_fs": None, "_files": {}}


def _chunk_rows(group: Any, batch_size: int) -> int:
    """Rows per decoded chunk of a row group (its Parquet metadata): whole batches, about CHUNK_BYTES."""
    row_bytes = group.total_byte_size / max(group.num_rows, 1)
    return batch_size * max(1, round(CHUNK_BYTES / max(row_bytes * batch_size, 1)))


def _check_shard(cur_shard: int | None, shard_count: int | None) -> tuple[int, int]:
    if cur_shard is None and shard_count is None:
        return 0, 1
    if cur_shard is None or shard_count is None or not 0 <= int(cur_shard) < int(shard_count):
        raise InvalidArgumentError(
            f"cur_shard={cur_shard!r}, shard_count={shard_count!r}: give both, with 0 <= cur_shard < shard_count "
            "(hvd.rank() and hvd.size()), or neither")
    return int(cur_shard), int(shard_count)


class DataLoader:
    """Batches of one rank's rows as dicts of tensors (Petastorm's ``petastorm.pytorch.DataLoader``).

    Iterating continues from the current position (see the module docstring); a fresh loader starts at
    epoch 0. ``state_dict()`` / ``load_state_dict()`` save and set the position; ``hvd.elastic.TorchState``
    handles a loader given as one of its attributes (it re-splits the rest of the epoch after a reset).

    Args:
        reader: a :class:`Reader` (what ``make_torch_dataloader`` makes).
        batch_size: rows per batch (each epoch's last batch of a rank may differ: ``phalanx.spark.shards``).
        shuffling_queue_capacity: above 0, shuffle rows within each row group (seeded).
        collate_fn: turns a NumPy batch into what the loop receives (default: tensors; ``numpy=True`` keeps
            NumPy).
    """

    #: ``hvd.elastic.TorchState`` keeps this object's ``state_dict()`` (phalanx.torch.elastic.handlers).
    elastic_resumable = True

    def __init__(self, reader: Reader, batch_size: int = 1, shuffling_queue_capacity: int = 0,
                 collate_fn: Callable[[Batch], Any] | None = None) -> None:
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise InvalidArgumentError(f"batch_size={batch_size!r}: give a positive int")
        self.reader, self.batch_size = reader, batch_size
        self.shuffle_rows = bool(shuffling_queue_capacity and shuffling_queue_capacity > 0)
        self.collate_fn = collate_fn or to_tensors
        self.rank, self.size = reader.cur_shard, reader.shard_count
        self._epoch, self._segments, self._taken = 0, [], 0  # type: int, list[tuple[int, int]], int

    # -- position ---------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The position: epoch, the segments ``[size, steps]`` of this epoch, and what they depend on."""
        segments = [list(s) for s in self._segments] + ([[self.size, self._taken]] if self._taken else [])
        return {"epoch": self._epoch, "segments": segments, "batch_size": self.batch_size,
                "seed": self.reader.seed, "rows": sum(self.reader.rows)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a :meth:`state_dict` (of this data, batch size and seed).

        Raises:
            UsageError: the state is of other data, another batch size or another seed.
        """
        mine = self.state_dict()
        for key in ("batch_size", "seed", "rows"):
            if int(state[key]) != mine[key]:
                raise UsageError(f"the loader state has {key}={state[key]}, this loader {mine[key]}: a position "
                                 "resumes only on the same data with the same batch_size and seed")
        self._epoch = int(state["epoch"])
        self._segments = [(int(s), int(k)) for s, k in state["segments"]]
        self._taken = 0

    def set_shard(self, cur_shard: int, shard_count: int) -> None:
        """Read as rank ``cur_shard`` of ``shard_count`` from the current position on (after a reset)."""
        if self._taken:
            self._segments.append((self.size, self._taken))
            self._taken = 0
        self.rank, self.size = _check_shard(cur_shard, shard_count)

    # -- iteration --------------------------------------------------------------------------------------
    def __iter__(self) -> Iterator[Any]:
        for batch in self.numpy_batches():
            yield self.collate_fn(batch)

    def numpy_batches(self) -> Iterator[Batch]:
        """The batches as NumPy, from the current position to the last epoch's end."""
        if not sum(self.reader.rows):
            raise UsageError(f"the data at {self.reader.url} has no rows to load; convert a DataFrame with rows")
        epochs = self.reader.num_epochs
        while epochs is None or self._epoch < epochs:
            yield from self._rest_of_epoch()
            self._epoch, self._segments, self._taken = self._epoch + 1, [], 0

    def _rest_of_epoch(self) -> Iterator[Batch]:
        left = shards.remaining(self.reader.order(self._epoch), self._segments, self.batch_size)
        share = shards.split(left, self.batch_size, self.size)
        rows, chunk = share.sizes[self.rank], share.chunks[self.rank]
        start = shards.consumed(rows, self.batch_size, share.steps, self._taken)
        pending = shards.batch_sizes(rows, self.batch_size, share.steps)[self._taken:]
        stream = _Rows(self._stream(shards.take(chunk, start, rows)))
        for want in pending:
            batch = self.reader.empty() if want == 0 else stream.take(want)
            self._taken += 1
            yield batch

    def _stream(self, runs: Sequence[Run]) -> Iterator[Batch]:
        for run in runs:
            yield from self.reader.chunks(run, self._epoch, self.shuffle_rows, self.batch_size)


class _Rows:
    """A stream of chunks cut into batches; the rows of a chunk beyond a batch wait for the next."""

    def __init__(self, chunks: Iterator[Batch]) -> None:
        self._chunks, self._carry = chunks, None  # type: Iterator[Batch], Batch | None

    def take(self, want: int) -> Batch:
        """The next ``want`` rows."""
        parts: list[Batch] = []
        have = 0
        while have < want:
            chunk = self._carry if self._carry is not None else next(self._chunks)
            self._carry = None
            rows = _rows(chunk)
            if have + rows > want:
                cut = want - have
                self._carry = {k: v[cut:] for k, v in chunk.items()}
                chunk, rows = {k: v[:cut] for k, v in chunk.items()}, cut
            parts.append(chunk)
            have += rows
        if len(parts) == 1:
            return parts[0]
        return {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}


def _rows(batch: Batch) -> int:
    return len(next(iter(batch.values()))) if batch else 0


def to_tensors(batch: Batch) -> dict[str, Any]:
    """Numbers and arrays as torch tensors, strings and bytes as lists. A tensor owns writable memory: one
    over Arrow's read-only buffers is copied, so the loop may change a batch in place."""
    import torch

    return {k: v.tolist() if v.dtype == object else torch.from_numpy(_writable(v)) for k, v in batch.items()}


def _writable(values: np.ndarray) -> np.ndarray:
    return values if values.flags.writeable and values.flags.c_contiguous else np.array(values, order="C")
