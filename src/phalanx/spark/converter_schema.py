"""Which DataFrame columns the converter takes, and the conversions Petastorm makes before writing them.

A loader turns numbers and booleans into tensors, fixed-length arrays of them into 2-D tensors, Spark ML
vectors (``pyspark.ml`` and ``pyspark.mllib``) into arrays first, and strings and binary (images as bytes)
into lists, which a ``transform_spec`` can decode. Anything else (maps, structs, dates, decimals, arrays
of strings or of arrays) is refused before Spark writes anything, with the column named.
"""

from __future__ import annotations

from typing import Any

from phalanx.errors import InvalidArgumentError


def _vector_types() -> tuple[type, ...]:
    from pyspark.ml.linalg import VectorUDT
    from pyspark.mllib.linalg import VectorUDT as OldVectorUDT

    return VectorUDT, OldVectorUDT


def _takes(data_type: Any) -> bool:
    from pyspark.sql.types import ArrayType, BinaryType, BooleanType, DecimalType, NumericType, StringType

    if isinstance(data_type, _vector_types()):
        return True
    if isinstance(data_type, ArrayType):
        element = data_type.elementType
        return isinstance(element, (NumericType, BooleanType)) and not isinstance(element, DecimalType)
    numeric = isinstance(data_type, (NumericType, BooleanType)) and not isinstance(data_type, DecimalType)
    return numeric or isinstance(data_type, (StringType, BinaryType))


def check_columns(df: Any) -> None:
    """Refuse the first column no loader can take.

    Raises:
        InvalidArgumentError: names the column, its type and the fix.
    """
    for field in df.schema.fields:
        if not _takes(field.dataType):
            raise InvalidArgumentError(
                f"column {field.name!r} has type {field.dataType.simpleString()}, which the converter cannot turn "
                "into tensors; it takes numbers, booleans, arrays of numbers, Spark ML vectors, strings and binary. "
                "Cast it (decimal to double, date/timestamp to long or string) or drop it with df.select(...)")


def converted(df: Any, dtype: str | None) -> Any:
    """``df`` with vectors as arrays of ``dtype`` (float64 when None) and, with ``dtype``, every
    float or double (and array of them) of the other precision cast to it (Petastorm's conversions)."""
    from pyspark.ml.functions import vector_to_array
    from pyspark.sql.types import ArrayType, DoubleType, FloatType

    for field in df.schema.fields:
        if isinstance(field.dataType, _vector_types()):
            df = df.withColumn(field.name, vector_to_array(df[field.name], dtype or "float64"))
    if dtype is None:
        return df
    source, target = (DoubleType, FloatType()) if dtype == "float32" else (FloatType, DoubleType())
    for field in df.schema.fields:
        kind = field.dataType
        if isinstance(kind, source):
            df = df.withColumn(field.name, df[field.name].cast(target))
        elif isinstance(kind, ArrayType) and isinstance(kind.elementType, source):
            df = df.withColumn(field.name, df[field.name].cast(ArrayType(target)))
    return df
