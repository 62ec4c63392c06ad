"""``Model.transform``: run the trained model on the executors, one Arrow batch at a time (``mapInArrow``).

Feature columns arrive as Arrow: numbers, lists of numbers, and ``pyspark.ml.linalg`` vectors as their
struct (``type`` 0 sparse / 1 dense, ``size``, ``indices``, ``values``), decoded here to dense NumPy rows
without a Python loop over rows. Each output column holds one row of the model's output: a double when the
output has one value per row, else a ``DenseVector`` (when the label was a vector) or an ``array<double>``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING

import numpy as np

from phalanx.spark.estimator.reader import to_numpy
from phalanx.spark.estimator.schema import VECTOR, ColumnSpec

if TYPE_CHECKING:
    import pyarrow as pa
    from pyspark.sql import DataFrame
    from pyspark.sql.types import DataType

Predictor = Callable[[list[np.ndarray]], list[np.ndarray]]


def vectors_to_numpy(column: pa.Array | pa.ChunkedArray, size: int) -> np.ndarray:
    """An Arrow ``VectorUDT`` struct column as a dense ``(rows, size)`` float32 array."""
    import pyarrow.compute as pc

    if hasattr(column, "combine_chunks"):
        column = column.combine_chunks()
    rows = len(column)
    kinds = np.asarray(column.field("type").to_numpy(zero_copy_only=False))
    values = column.field("values")
    lengths = np.asarray(pc.list_value_length(values).fill_null(0).to_numpy(zero_copy_only=False), dtype=np.int64)
    flat = np.asarray(values.flatten().to_numpy(zero_copy_only=False), dtype=np.float32)
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
    row_of = np.repeat(np.arange(rows), lengths)
    col_of = np.arange(len(flat)) - np.repeat(starts, lengths)
    sparse = np.repeat(kinds == 0, lengths)
    if sparse.any():
        col_of[sparse] = np.asarray(column.field("indices").flatten().to_numpy(zero_copy_only=False))
    out = np.zeros((rows, size), dtype=np.float32)
    out[row_of, col_of] = flat
    return out


def column_to_numpy(column: pa.Array | pa.ChunkedArray, spec: ColumnSpec) -> np.ndarray:
    """A feature column of an Arrow batch as NumPy ``(rows,)`` or ``(rows, size)``."""
    if spec.kind == VECTOR:
        return vectors_to_numpy(column, spec.size)
    return to_numpy(column, spec)


def output_type(size: int, vector: bool) -> DataType:
    """The Spark type of an output column with ``size`` values per row."""
    from pyspark.ml.linalg import VectorUDT
    from pyspark.sql.types import ArrayType, DoubleType

    if size == 1:
        return DoubleType()
    return VectorUDT() if vector else ArrayType(DoubleType())


def _to_arrow(values: np.ndarray, rows: int, size: int, vector: bool) -> pa.Array:
    import pyarrow as pa

    flat = np.asarray(values, dtype=np.float64).reshape(rows, -1)
    if size == 1:
        return pa.array(flat[:, 0])
    lists = pa.ListArray.from_arrays(pa.array(np.arange(0, rows * size + 1, size, dtype=np.int32)),
                                     pa.array(flat.reshape(-1)))
    if not vector:
        return lists
    return pa.StructArray.from_arrays(
        [pa.array(np.ones(rows, dtype=np.int8)), pa.nulls(rows, pa.int32()),
         pa.nulls(rows, pa.list_(pa.int32())), lists], names=["type", "size", "indices", "values"])


def _driver_modules() -> tuple[dict[str, bytes], tuple[str, ...]]:
    """The driver-local modules and the driver's ``sys.path``, as a ``phalanx.spark`` job ships them: the
    model's classes may live next to the driver's script (or in a test or notebook directory)."""
    from phalanx.job.payload import driver_sys_path
    from phalanx.job.shipping import collect_modules, driver_root

    return collect_modules(driver_root()), tuple(driver_sys_path())


_INSTALLED: dict[int, str] = {}


def _install_modules(files: dict[str, bytes], paths: Sequence[str]) -> None:
    """Executor side: write the shipped modules once per python worker, put them first on ``sys.path``,
    and append the driver's path entries that exist here."""
    import os
    import sys
    import tempfile
    from pathlib import Path

    key = hash(tuple(sorted((k, hash(v)) for k, v in files.items())))
    if files and key not in _INSTALLED:
        directory = tempfile.mkdtemp(prefix="phalanx-modules-")
        for rel, data in files.items():
            target = Path(directory, rel)
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(data)
        _INSTALLED[key] = directory
        sys.path.insert(0, directory)
    sys.path.extend(p for p in paths if p and p not in sys.path and os.path.isdir(p))


def transform(df: DataFrame, features: Sequence[ColumnSpec], outputs: Sequence[tuple[str, int, bool]],
              make_predictor: Callable[[], Predictor]) -> DataFrame:
    """``df`` with one column per ``(name, size, vector)`` output, computed on the executors.

    Args:
        df: the DataFrame; it must hold the feature columns (any other columns pass through).
        features: the feature columns as the model was trained on them.
        outputs: the output columns: name, values per row, whether a ``DenseVector``.
        make_predictor: builds the predictor on the executor (loads the model once per task).
    """
    from pyspark.sql.types import StructField, StructType

    from phalanx.spark.estimator.schema import column_kind

    # The kind comes from this DataFrame (a model trained on arrays may transform vectors).
    features = [ColumnSpec(s.name, column_kind(df, s.name, "feature")[0], s.size, "float32") for s in features]
    schema = StructType([*df.schema.fields, *(StructField(n, output_type(s, v)) for n, s, v in outputs)])
    names = [*df.schema.names, *(n for n, _, _ in outputs)]
    files, paths = _driver_modules()

    def run(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        import pyarrow as pa

        _install_modules(files, paths)
        predict = make_predictor()
        for batch in batches:
            if batch.num_rows == 0:
                continue
            inputs = [column_to_numpy(batch.column(spec.name), spec) for spec in features]
            results = predict(inputs)
            columns = [_to_arrow(r, batch.num_rows, s, v) for r, (_, s, v) in zip(results, outputs)]
            yield pa.RecordBatch.from_arrays([*batch.columns, *columns], names=names)

    return df.mapInArrow(run, schema)
