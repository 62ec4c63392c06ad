"""``LogCallback``: Keras training logs on the driver's console (``sparkdl.horovod.tensorflow.keras.LogCallback``).

Imports TensorFlow (the optional extra ``phalanx[tensorflow]``); ``phalanx.spark`` itself never imports this
module. The callback is a ``tf.keras.callbacks.Callback``, of the Keras TensorFlow chose for ``tf.keras``
(Keras 3, or ``tf_keras`` under ``TF_USE_LEGACY_KERAS=1``): each Keras' ``fit`` takes only its own callbacks.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import SupportsFloat, TypeGuard

import tensorflow as tf

from phalanx.spark.driver_log import log_to_driver


def _format(logs: Mapping[str, object] | None) -> str:
    return ", ".join(f"{k}: {float(v):.4f}" if _is_number(v) else f"{k}: {v}" for k, v in sorted((logs or {}).items()))


def _is_number(value: object) -> TypeGuard[SupportsFloat | str]:
    try:
        float(value)  # type: ignore[arg-type]  # what this finds out
    except (TypeError, ValueError):
        return False
    return True


class LogCallback(tf.keras.callbacks.Callback):
    """Send each epoch's (and optionally each batch's) logs to the driver with :func:`log_to_driver`.

    Every rank that has the callback sends its own lines (the driver prefixes them with the rank); pass it
    on rank 0 only for one line per epoch. In a Spark job the lines travel on the job's channel, so they
    show with ``HorovodRunner``'s default ``driver_log_verbosity="log_callback_only"``.

    Args:
        per_batch_log: also send a line after every training batch.
    """

    def __init__(self, per_batch_log: bool = False) -> None:
        super().__init__()
        self.per_batch_log = per_batch_log
        self._epoch = 0

    def on_epoch_begin(self, epoch: int, logs: Mapping[str, object] | None = None) -> None:
        """Remember the epoch for the batch lines."""
        self._epoch = epoch

    def on_train_batch_end(self, batch: int, logs: Mapping[str, object] | None = None) -> None:
        """With ``per_batch_log``: ``epoch 1 batch 3: loss: 0.1234, ...``."""
        if self.per_batch_log:
            log_to_driver(f"epoch {self._epoch + 1} batch {batch + 1}: {_format(logs)}")

    def on_epoch_end(self, epoch: int, logs: Mapping[str, object] | None = None) -> None:
        """``epoch 1: accuracy: 0.9000, loss: 0.1234, ...``."""
        log_to_driver(f"epoch {epoch + 1}: {_format(logs)}")
