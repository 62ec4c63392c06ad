"""``SyncBatchNormalization``: batch normalization over the whole global batch (Horovod's layer).

In training, each rank sums its batch's values and squares per channel and counts its rows; one allreduce
(``Sum``) of those makes the mean and variance of the global batch, so ranks with different batch sizes
weigh correctly. The allreduce is differentiable (its gradient is the allreduce of the incoming gradient),
so the backward pass sees the global statistics too. Inference, masks and a world of one rank use Keras'
own ``BatchNormalization``.

The layer subclasses the ``BatchNormalization`` of the Keras ``tf.keras`` is (``keras_flavour``): Keras 3
computes the statistics in ``_moments(inputs, mask)``, Keras 2 (``tf_keras``) in
``_calculate_mean_and_var(inputs, reduction_axes, keep_dims, mask)``; the matching hook is overridden.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import tensorflow as tf

from phalanx.errors import InvalidArgumentError
from phalanx.tensorflow import keras_flavour
from phalanx.tensorflow.ops import allreduce
from phalanx.torch import basics
from phalanx.torch import frontend as reduce_ops

keras: Any = keras_flavour.keras()


def _synchronized(mask: Any) -> bool:
    return mask is None and basics.is_initialized() and basics.size() > 1


def _global_moments(name: str, inputs: Any, axes: Sequence[int], keep_dims: bool) -> tuple[Any, Any]:
    """Mean and variance of ``inputs`` over ``axes`` of every rank's batch (one ``Sum`` allreduce)."""
    local_sum = tf.reduce_sum(inputs, axis=axes, keepdims=keep_dims)
    local_squares = tf.reduce_sum(tf.square(inputs), axis=axes, keepdims=keep_dims)
    count = tf.cast(tf.reduce_prod(tf.gather(tf.shape(inputs), axes)), inputs.dtype)
    channels = tf.size(local_sum)
    packed = tf.concat([tf.reshape(local_sum, [-1]), tf.reshape(local_squares, [-1]), [count]], axis=0)
    total = allreduce(packed, op=reduce_ops.Sum, name=f"SyncBatchNormalization.{name}")
    n = total[-1]
    mean = tf.reshape(total[:channels] / n, tf.shape(local_sum))
    mean_of_squares = tf.reshape(total[channels : 2 * channels] / n, tf.shape(local_sum))
    return mean, tf.maximum(mean_of_squares - tf.square(mean), 0.0)


class _Keras3Statistics:
    def _moments(self, inputs: Any, mask: Any) -> Any:
        if not _synchronized(mask):
            return super()._moments(inputs, mask)  # type: ignore[misc]
        return _global_moments(self.name, inputs, list(self._reduction_axes), False)  # type: ignore[attr-defined]


class _Keras2Statistics:
    def _calculate_mean_and_var(self, inputs: Any, reduction_axes: Sequence[int], keep_dims: bool,
                                mask: Any = None) -> Any:
        if not _synchronized(mask):
            return super()._calculate_mean_and_var(inputs, reduction_axes, keep_dims, mask=mask)  # type: ignore[misc]
        return _global_moments(self.name, inputs, list(reduction_axes), keep_dims)  # type: ignore[attr-defined]


_STATISTICS: Any = _Keras3Statistics if keras_flavour.is_keras3() else _Keras2Statistics


class SyncBatchNormalization(_STATISTICS, keras.layers.BatchNormalization):
    """Keras' ``BatchNormalization`` with statistics over every rank's batch (same arguments).

    Args:
        fused: TensorFlow's fused kernel, which cannot synchronize: only False is accepted (Horovod's rule;
            Keras 2 is then given ``fused=False``, Keras 3 has no fused kernel).
        **kwargs: as for ``BatchNormalization``.

    Raises:
        InvalidArgumentError: ``fused`` is True or None.
    """

    def __init__(self, *args: Any, fused: bool | None = False, **kwargs: Any) -> None:
        if fused is not False:
            raise InvalidArgumentError(f"SyncBatchNormalization does not support fused={fused!r}: pass "
                                       "fused=False or leave it out")
        if not keras_flavour.is_keras3():
            kwargs["fused"] = False
        super().__init__(*args, **kwargs)
