"""``make_tf_dataset``'s ``tf.data.Dataset``: a converter loader's batches as named tuples of tensors."""

from __future__ import annotations

import collections
from collections.abc import Iterator
from types import ModuleType
from typing import TYPE_CHECKING

import numpy as np

from phalanx.spark.loader import DataLoader

if TYPE_CHECKING:
    import tensorflow


def _spec(tf: ModuleType, name: str, values: np.ndarray) -> tensorflow.TensorSpec:
    if values.dtype == object:
        return tf.TensorSpec(shape=(None,), dtype=tf.string, name=name)
    return tf.TensorSpec(shape=(None, *values.shape[1:]), dtype=tf.as_dtype(values.dtype), name=name)


def make_dataset(loader: DataLoader, prefetch: int | None) -> tensorflow.data.Dataset:
    """A ``tf.data.Dataset`` over ``loader``'s NumPy batches: each element a named tuple of the columns
    (Petastorm's), prefetched ``prefetch`` batches (None: ``tf.data.AUTOTUNE``)."""
    import tensorflow as tf

    first = loader.reader.empty()
    row = collections.namedtuple("inferred_schema_view", list(first))  # type: ignore[misc]
    signature = row(*(_spec(tf, name, values) for name, values in first.items()))

    def batches() -> Iterator[tuple[np.ndarray | list[object], ...]]:
        for batch in loader.numpy_batches():
            yield row(*(_strings(batch[name]) for name in first))

    dataset = tf.data.Dataset.from_generator(batches, output_signature=signature)
    return dataset.prefetch(tf.data.AUTOTUNE if prefetch is None else prefetch)


def _strings(values: np.ndarray) -> np.ndarray | list[object]:
    return [v.encode() if isinstance(v, str) else v for v in values] if values.dtype == object else values


__all__ = ["make_dataset"]
