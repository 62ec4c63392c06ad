"""Turn the user's DataFrame into the run's Parquet data in the store, checking it first (on the driver).

One aggregation pass checks that the DataFrame has rows and that every array or vector column has one
size; a small probe job checks that every executor can write to the store; then Spark writes the training
and validation rows (vectors and arrays as ``array<float>``, sparse vectors densified) and the driver lists
the Parquet row groups, which the ranks share out between them (``reader.assign``).
"""

from __future__ import annotations

import logging
import socket
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from phalanx.errors import InvalidArgumentError
from phalanx.spark.converter import pieces_of
from phalanx.spark.estimator.reader import Piece
from phalanx.spark.estimator.schema import ARRAY, SCALAR, VECTOR, ColumnSpec, check_shapes, column_kind
from phalanx.spark.estimator.store import Store

if TYPE_CHECKING:
    from pyspark.sql import Column, DataFrame

log = logging.getLogger("phalanx")

#: Row-group size of the intermediate Parquet data: a rank holds about one row group in memory.
ROW_GROUP_BYTES = 8 << 20


@dataclass(frozen=True)
class Prepared:
    """The run's data as the ranks read it.

    Attributes:
        features, labels: the feature and label columns.
        weight: the sample-weight column, if any.
        train, val: the row groups of the training / validation data (``val`` empty without validation).
        train_rows, val_rows: their row counts.
    """

    features: tuple[ColumnSpec, ...]
    labels: tuple[ColumnSpec, ...]
    weight: ColumnSpec | None
    train: tuple[Piece, ...]
    val: tuple[Piece, ...]
    train_rows: int
    val_rows: int


def _converted(df: DataFrame, name: str, kind: str, integral: bool, feature: bool) -> tuple[Column, str]:
    from pyspark.ml.functions import vector_to_array
    from pyspark.sql import functions as F
    from pyspark.sql.types import ArrayType, FloatType, LongType

    dtype = "int64" if integral and not feature else "float32"
    element = LongType() if dtype == "int64" else FloatType()
    if kind == VECTOR:
        return vector_to_array(F.col(name), "float32").alias(name), dtype
    if kind == ARRAY:
        return F.col(name).cast(ArrayType(element)).alias(name), dtype
    return F.col(name).cast(element).alias(name), dtype


def _sizes(df: DataFrame, arrays: list[str]) -> tuple[int, dict[str, tuple[int, int]]]:
    from pyspark.sql import functions as F

    aggs = [F.count(F.lit(1)).alias("__rows")]
    for i, name in enumerate(arrays):
        aggs += [F.min(F.size(F.col(name))).alias(f"__min{i}"), F.max(F.size(F.col(name))).alias(f"__max{i}")]
    row = df.agg(*aggs).collect()[0]
    if not row["__rows"]:
        return 0, {}
    return int(row["__rows"]), {n: (int(row[f"__min{i}"]), int(row[f"__max{i}"])) for i, n in enumerate(arrays)}


def select_columns(df: DataFrame, features: Sequence[str], labels: Sequence[str], weight: str | None,
                   validation: object) -> tuple[DataFrame, dict[str, ColumnSpec], int]:
    """Check and convert the columns; return the converted DataFrame, each column's spec and the row count.

    Raises:
        InvalidArgumentError: a missing column, a type that cannot become a tensor, an empty DataFrame, an
            array or vector column whose rows differ in size.
    """
    roles = [(n, "feature", True) for n in features] + [(n, "label", False) for n in labels]
    if weight:
        roles.append((weight, "sample_weight_col", False))
    kinds = {name: (*column_kind(df, name, role), feature) for name, role, feature in roles}
    exprs, dtypes = [], {}
    for name, (kind, integral, feature) in kinds.items():
        expr, dtypes[name] = _converted(df, name, kind, integral, feature)
        exprs.append(expr)
    if isinstance(validation, str):
        column_kind(df, validation, "validation")
        exprs.append(df[validation].cast("boolean").alias("__val"))
    selected = df.select(*exprs)
    rows, sizes = _sizes(selected, [n for n, (k, _, _) in kinds.items() if k != SCALAR])
    if rows == 0:
        raise InvalidArgumentError("the DataFrame given to fit() has no rows; give it some data to train on")
    for name, (low, high) in sizes.items():
        if low != high:
            raise InvalidArgumentError(
                f"column {name!r} has rows of different sizes ({low} to {high} values); every row of an array "
                "or vector column must have the same size")
    specs = {n: ColumnSpec(n, k, sizes.get(n, (1, 1))[0], dtypes[n]) for n, (k, _, _) in kinds.items()}
    return selected, specs, rows


def check_writable(store: Store, run_id: str, tasks: int) -> None:
    """Write and delete a probe file from ``tasks`` Spark tasks, so an unwritable store fails now, clearly.

    Raises:
        InvalidArgumentError: some executor could not write; names its host, the path and the error.
    """
    from phalanx.spark.session import spark_context

    probe_dir = f"{store.get_run_path(run_id)}/probe"

    def probe(index: int) -> list[str]:
        path = f"{probe_dir}/{socket.gethostname()}-{index}"
        try:
            store.write(path, b"ok")
            store.remove(path)
        except Exception as e:  # any filesystem error is reported, with its type
            return [f"{socket.gethostname()}: {type(e).__name__}: {e}"]
        return []

    sc = spark_context()
    failures = sc.parallelize(range(tasks), tasks).flatMap(probe).collect()
    if failures:
        raise InvalidArgumentError(
            f"the store {store} cannot be written from the executors at {probe_dir}: {failures[0]}"
            f"{f' (and {len(failures) - 1} more)' if len(failures) > 1 else ''}; give store= a path every "
            "executor can write (a shared filesystem in a cluster)")
    store.remove(probe_dir)


def list_pieces(store: Store, path: str) -> tuple[Piece, ...]:
    """Every non-empty Parquet row group under ``path``, in file-name order."""
    return tuple(pieces_of(store.fs, path))


def write_split(df: DataFrame, store: Store, path: str, partitions: int) -> tuple[tuple[Piece, ...], int]:
    """Write ``df`` as Parquet at ``path``; return its row groups and row count."""
    (df.repartition(partitions).write.mode("overwrite").option("parquet.block.size", ROW_GROUP_BYTES)
     .parquet(store.spark_url(path)))
    pieces = list_pieces(store, path)
    return pieces, sum(p.rows for p in pieces)


def split(df: DataFrame, validation: object, seed: int) -> tuple[DataFrame, DataFrame | None]:
    """``(train, val)``: by a 0/1 column, by a random fraction (seeded), or no validation."""
    from pyspark.sql import functions as F

    if isinstance(validation, str):
        flag = F.coalesce(F.col("__val"), F.lit(False))
        return df.where(~flag).drop("__val"), df.where(flag).drop("__val")
    if isinstance(validation, (int, float)) and validation > 0:
        train, val = df.randomSplit([1.0 - float(validation), float(validation)], seed=seed)
        return train, val
    return df, None


def prepare(df: DataFrame, store: Store, run_id: str, params: dict[str, Any], num_proc: int) -> Prepared:
    """Check the DataFrame and the store, write the run's data; see the module docstring.

    Raises:
        InvalidArgumentError: any bad input (columns, types, sizes, shapes, no rows, unwritable store).
    """
    features, labels = list(params["feature_cols"]), list(params["label_cols"])
    weight, validation = params.get("sample_weight_col"), params.get("validation")
    selected, specs, _ = select_columns(df, features, labels, weight, validation)
    check_shapes([specs[n] for n in features], params.get("input_shapes"), "input_shapes")
    check_shapes([specs[n] for n in labels], params.get("label_shapes"), "label_shapes")
    check_writable(store, run_id, num_proc)
    train_df, val_df = split(selected, validation, params.get("random_seed") or 0)
    partitions = max(1, num_proc * int(params.get("partitions_per_process") or 1))
    train, train_rows = write_split(train_df, store, store.get_train_data_path(run_id), partitions)
    if train_rows < num_proc:
        raise InvalidArgumentError(
            f"{train_rows} training row(s) for {num_proc} ranks: every rank needs at least one; give more rows, "
            "fewer ranks (num_proc) or a smaller validation")
    val: tuple[Piece, ...] = ()
    val_rows = 0
    if val_df is not None:
        val, val_rows = write_split(val_df, store, store.get_val_data_path(run_id), partitions)
        if val_rows == 0:
            raise InvalidArgumentError(f"validation={validation!r} selected no rows; give a larger fraction or "
                                       "mark some rows in the validation column")
    log.info("phalanx estimator: %d training and %d validation rows in %s", train_rows, val_rows,
             store.get_run_path(run_id))
    return Prepared(tuple(specs[n] for n in features), tuple(specs[n] for n in labels),
                    specs[weight] if weight else None, train, val, train_rows, val_rows)
