"""A rank's share of the run's Parquet data, streamed in batches of NumPy arrays (pyarrow; no torch).

Sharding: the row groups are shared out so that the ranks' row counts are as even as the groups allow
(the largest group first, to the rank with the fewest rows, ties to the lower rank); with fewer groups than
ranks every rank reads every group and keeps every ``size``-th row from its rank on. Every rank computes
the same assignment from the same list.

Equal steps: an epoch is a fixed number of batches on every rank (``steps``); a rank whose share runs out
starts it again (reshuffled), so no rank skips a collective the others take.

Shuffling: with ``shuffle``, each pass over the share visits the row groups in a random order and the rows
of each group in a random order, from a generator seeded by ``(seed, epoch, rank, pass)``: the same epoch
gives the same batches on a re-run or a resumed run. Memory: one row group and one batch at a time.
"""

from __future__ import annotations

import itertools
import math
import queue
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import IO, TYPE_CHECKING, Any, TypeVar

import numpy as np

from phalanx.errors import UsageError
from phalanx.spark.estimator.schema import SCALAR, ColumnSpec
from phalanx.spark.shards import Piece

if TYPE_CHECKING:
    import pyarrow as pa

Batch = dict[str, np.ndarray]


def assign(pieces: Sequence[Piece], rank: int, size: int) -> tuple[list[Piece], int]:
    """``(pieces, stride)`` of ``rank``: its own row groups and 1, or every group and ``size`` (see above)."""
    if len(pieces) < size:
        return list(pieces), size
    loads = [0] * size
    mine: list[list[Piece]] = [[] for _ in range(size)]
    for piece in sorted(pieces, key=lambda p: (-p.rows, p.path, p.row_group)):
        target = min(range(size), key=lambda r: (loads[r], r))
        loads[target] += piece.rows
        mine[target].append(piece)
    return sorted(mine[rank], key=lambda p: (p.path, p.row_group)), 1


def steps_per_epoch(rows: int, batch_size: int, size: int, requested: int | None, training: bool) -> int:
    """Horovod's count: training floors ``rows / (batch_size * size)``, validation takes the ceiling; at
    least 1; ``requested`` (``*_steps_per_epoch``) wins when given."""
    if requested:
        return int(requested)
    share = rows / (batch_size * size)
    return max(1, math.floor(share) if training else math.ceil(share))


def to_numpy(column: pa.Array | pa.ChunkedArray, spec: ColumnSpec) -> np.ndarray:
    """A pyarrow column (array or chunked) as a NumPy array ``(rows,)`` or ``(rows, size)`` of ``spec.dtype``."""
    if hasattr(column, "combine_chunks"):
        column = column.combine_chunks()
    if spec.kind == SCALAR:
        return np.asarray(column.to_numpy(zero_copy_only=False), dtype=spec.dtype)
    values = column.flatten().to_numpy(zero_copy_only=False)
    return np.asarray(values, dtype=spec.dtype).reshape(len(column), spec.size)


class ShardReader:
    """Batches of one rank's share of a split, a fixed number per epoch.

    Args:
        open_file: opens a path for binary reading (``Store.open_read``).
        pieces: every row group of the split (the same list on every rank).
        columns: the columns to read.
        rank, size: this rank and the number of ranks.
        batch_size: rows per batch.
        shuffle: shuffle row groups and rows every pass.
        seed: the shuffling seed.
    """

    def __init__(self, open_file: Callable[[str], IO[bytes]], pieces: Sequence[Piece],
                 columns: Sequence[ColumnSpec], rank: int, size: int, batch_size: int, shuffle: bool,
                 seed: int) -> None:
        self._open = open_file
        self.pieces, self._stride = assign(pieces, rank, size)
        self._offsets = _offsets(pieces) if self._stride > 1 else {}
        self.columns = list(columns)
        self.rank, self.batch_size, self.shuffle, self.seed = rank, batch_size, shuffle, seed

    def epoch(self, epoch: int, steps: int) -> Iterator[Batch]:
        """Exactly ``steps`` batches of ``batch_size`` rows for ``epoch`` (passes over the share chain)."""
        batches = self._batches(self._stream(epoch))
        for _ in range(steps):
            yield next(batches)

    def _stream(self, epoch: int) -> Iterator[Batch]:
        for index in itertools.count():
            rows = 0
            for chunk in self._pass(epoch, index):
                rows += _rows(chunk)
                yield chunk
            if rows == 0:
                raise UsageError(f"rank {self.rank} has no rows to read in {len(self.pieces)} row group(s)")

    def _pass(self, epoch: int, index: int) -> Iterator[Batch]:
        rng = np.random.default_rng([self.seed, epoch, self.rank, index]) if self.shuffle else None
        order = rng.permutation(len(self.pieces)) if rng is not None else range(len(self.pieces))
        for i in order:
            chunk = self._read(self.pieces[int(i)])
            if rng is not None:
                perm = rng.permutation(_rows(chunk))
                chunk = {k: v[perm] for k, v in chunk.items()}
            yield chunk

    def _read(self, piece: Piece) -> Batch:
        import pyarrow.parquet as pq

        with self._open(piece.path) as f:
            table = pq.ParquetFile(f).read_row_group(piece.row_group, columns=[c.name for c in self.columns])
        chunk = {c.name: to_numpy(table.column(c.name), c) for c in self.columns}
        if self._stride > 1:
            first = (self.rank - self._offsets[piece]) % self._stride
            chunk = {k: v[first::self._stride] for k, v in chunk.items()}
        return chunk

    def _batches(self, chunks: Iterator[Batch]) -> Iterator[Batch]:
        carry: Batch | None = None
        size = self.batch_size
        for chunk in chunks:
            if carry is not None:
                chunk = {k: np.concatenate([carry[k], v]) for k, v in chunk.items()}
            rows = _rows(chunk)
            full = rows - rows % size
            for start in range(0, full, size):
                yield {k: v[start:start + size] for k, v in chunk.items()}
            carry = {k: v[full:] for k, v in chunk.items()}


def _offsets(pieces: Sequence[Piece]) -> dict[Piece, int]:
    offsets, total = {}, 0
    for piece in pieces:
        offsets[piece] = total
        total += piece.rows
    return offsets


def _rows(chunk: Batch) -> int:
    return len(next(iter(chunk.values()))) if chunk else 0


T = TypeVar("T")


class _Failed:
    def __init__(self, error: BaseException) -> None:
        self.error = error


_END = object()
PREFETCH_POLL_S = 0.1


def prefetched(items: Iterator[T], depth: int) -> Iterator[T]:
    """``items`` read up to ``depth`` ahead on a daemon thread (Horovod's ``prefetch`` of the TF dataset),
    in order; an error while reading is raised where its item would have come. When the consumer stops
    early (``fit`` takes ``steps_per_epoch`` batches), the thread stops at its next item."""
    ready: queue.Queue[Any] = queue.Queue(maxsize=depth)
    stop = threading.Event()

    def fill() -> None:
        try:
            for item in items:
                while not stop.is_set():
                    try:
                        ready.put(item, timeout=PREFETCH_POLL_S)
                        break
                    except queue.Full:
                        continue
                if stop.is_set():
                    return
            ready.put(_END)
        except BaseException as e:  # handed to the consumer, in order
            ready.put(_Failed(e))

    threading.Thread(target=fill, name="phalanx-prefetch", daemon=True).start()
    try:
        while (item := ready.get()) is not _END:
            if isinstance(item, _Failed):
                raise item.error
            yield item
    finally:
        stop.set()
