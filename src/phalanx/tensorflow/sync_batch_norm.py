"""``SyncBatchNormalization``: batch normalization over the whole global batch (Horovod's layer, Keras 3).

In training, each rank sums its batch's values and squares per channel and counts its rows; one allreduce
(``Sum``) of those makes the mean and variance of the global batch, so ranks with different batch sizes
weigh correctly. The allreduce is differentiable (its gradient is the allreduce of the incoming gradient),
so the backward pass sees the global statistics too. Inference, masks and a world of one rank use Keras'
own ``BatchNormalization``.
"""

from __future__ import annotations

from typing import Any

import keras
import tensorflow as tf

from phalanx.tensorflow.ops import allreduce
from phalanx.torch import basics
from phalanx.torch import frontend as reduce_ops


class SyncBatchNormalization(keras.layers.BatchNormalization):
    """Keras' ``BatchNormalization`` with statistics over every rank's batch (same arguments).

    ``fused`` (TensorFlow 1's fused kernel, which Horovod turns off) is accepted and ignored.
    """

    def __init__(self, *args: Any, fused: bool = False, **kwargs: Any) -> None:
        del fused
        super().__init__(*args, **kwargs)

    def _moments(self, inputs: Any, mask: Any) -> Any:
        if mask is not None or not basics.is_initialized() or basics.size() == 1:
            return super()._moments(inputs, mask)
        axes = list(self._reduction_axes)
        local_sum = tf.reduce_sum(inputs, axis=axes)
        local_squares = tf.reduce_sum(tf.square(inputs), axis=axes)
        count = tf.cast(tf.reduce_prod(tf.gather(tf.shape(inputs), axes)), inputs.dtype)
        channels = tf.size(local_sum)
        packed = tf.concat([tf.reshape(local_sum, [-1]), tf.reshape(local_squares, [-1]), [count]], axis=0)
        total = allreduce(packed, op=reduce_ops.Sum, name=f"SyncBatchNormalization.{self.name}")
        n = total[-1]
        mean = tf.reshape(total[:channels] / n, tf.shape(local_sum))
        mean_of_squares = tf.reshape(total[channels : 2 * channels] / n, tf.shape(local_sum))
        return mean, tf.maximum(mean_of_squares - tf.square(mean), 0.0)
