"""What each column is, checked on the driver from the DataFrame's schema before any job runs.

A column reaches the ranks as a fixed-size row of numbers: a number (size 1), an array of numbers, or a
``pyspark.ml.linalg`` vector (dense or sparse, stored dense). Features become float32; labels and sample
weights keep integers as int64 (class indices) and everything else as float32.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from phalanx.errors import InvalidArgumentError

if TYPE_CHECKING:
    from pyspark.sql import DataFrame

SCALAR, ARRAY, VECTOR = "scalar", "array", "vector"


@dataclass(frozen=True)
class ColumnSpec:
    """One column as the ranks read it.

    Attributes:
        name: the column's name.
        kind: ``scalar``, ``array`` or ``vector`` (its type in the DataFrame).
        size: numbers per row (1 for a scalar).
        dtype: NumPy dtype on the ranks (``float32`` or ``int64``).
    """

    name: str
    kind: str
    size: int
    dtype: str


def column_kind(df: DataFrame, name: str, role: str) -> tuple[str, bool]:
    """``(kind, integral)`` of column ``name``.

    Raises:
        InvalidArgumentError: the column is missing, or of a type that cannot become a tensor.
    """
    from pyspark.ml.linalg import VectorUDT
    from pyspark.sql.types import ArrayType, BooleanType, IntegralType, NumericType

    if name not in df.columns:
        raise InvalidArgumentError(
            f"{role} column {name!r} is not in the DataFrame; its columns are {df.columns}")
    dtype = df.schema[name].dataType
    if isinstance(dtype, VectorUDT):
        return VECTOR, False
    if isinstance(dtype, (NumericType, BooleanType)):
        return SCALAR, isinstance(dtype, (IntegralType, BooleanType))
    if isinstance(dtype, ArrayType) and isinstance(dtype.elementType, (NumericType, BooleanType)):
        return ARRAY, isinstance(dtype.elementType, (IntegralType, BooleanType))
    raise InvalidArgumentError(
        f"{role} column {name!r} has type {dtype.simpleString()}, which cannot become a tensor; use a number, "
        "an array of numbers or a pyspark.ml.linalg vector (convert it with a select before fit)")


def check_validation(validation: object) -> None:
    """Horovod's rule: ``validation`` is None, a fraction in [0, 1) or a column name.

    Raises:
        InvalidArgumentError: anything else (a fraction of 1 or more leaves nothing to train on).
    """
    if validation is None or isinstance(validation, str):
        return
    if isinstance(validation, bool) or not isinstance(validation, (int, float)):
        raise InvalidArgumentError(f"validation={validation!r}: give a fraction in [0, 1) or a column name")
    if not 0 <= float(validation) < 1:
        raise InvalidArgumentError(
            f"validation={validation!r} is outside [0, 1): it is the fraction of rows held out for validation "
            "(e.g. 0.1), and the rest are trained on")


def check_shapes(specs: Sequence[ColumnSpec], shapes: Sequence[Sequence[int]] | None, what: str) -> None:
    """Check that each column's row size fits its shape (``[-1, d1, d2...]``: the product of the dims).

    Raises:
        InvalidArgumentError: a count or a size mismatch, naming the column, its size and the shape.
    """
    if shapes is None:
        return
    if len(shapes) != len(specs):
        raise InvalidArgumentError(
            f"{what} has {len(shapes)} shape(s) for {len(specs)} column(s) {[s.name for s in specs]}; give one each")
    for spec, shape in zip(specs, shapes):
        dims = [int(d) for d in shape]
        rest = dims[1:] if dims and dims[0] in (-1, None) else dims
        if any(d <= 0 for d in rest) or math.prod(rest) != spec.size:
            raise InvalidArgumentError(
                f"column {spec.name!r} has {spec.size} value(s) per row, which does not fit {what} entry {list(shape)} "
                f"(needs {math.prod(rest) if all(d > 0 for d in rest) else 'positive dims'}); fix the shape or the "
                "column")


#: ``input_shapes`` / ``label_shapes``: one shape per column, the batch dimension first as -1.
Shapes = Sequence[Sequence[int]]


def row_shape(spec: ColumnSpec, shape: Sequence[int] | None) -> tuple[int, ...]:
    """The per-row shape of a column on the ranks: the given shape without its batch dim, else its size."""
    if shape is None:
        return () if spec.kind == SCALAR else (spec.size,)
    dims = [int(d) for d in shape]
    return tuple(dims[1:] if dims and dims[0] in (-1, None) else dims)
