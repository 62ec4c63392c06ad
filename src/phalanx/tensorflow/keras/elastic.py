"""Elastic Keras training (Horovod's ``horovod.tensorflow.keras.elastic``)::

    state = hvd.elastic.KerasState(model, batch=0, epoch=0)

    @hvd.elastic.run
    def train(state):
        model.fit(x, y, initial_epoch=state.epoch, epochs=5, steps_per_epoch=..., callbacks=[
            hvd.elastic.CommitStateCallback(state), hvd.elastic.UpdateBatchStateCallback(state),
            hvd.elastic.UpdateEpochStateCallback(state)])

    train(state)
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from phalanx.tensorflow import keras_flavour
from phalanx.tensorflow.elastic import TensorFlowKerasState, run
from phalanx.tensorflow.tf_types import CommittableState, KerasModelLike, KerasOptimizerLike

keras: Any = keras_flavour.keras()  # the callbacks are the Keras tf.keras is (Keras 3 or tf_keras)


class KerasState(TensorFlowKerasState):
    """A Keras model, its optimizer and plain attributes (``epoch``, ``batch``, ...).

    Args:
        model: a built Keras model.
        optimizer: its optimizer (default: ``model.optimizer``).
        **kwargs: plain attributes and their initial values.
    """

    def __init__(self, model: KerasModelLike, optimizer: KerasOptimizerLike | None = None, **kwargs: Any) -> None:
        super().__init__(model, optimizer=optimizer, **kwargs)


class CommitStateCallback(keras.callbacks.Callback):
    """Commit the state every ``batches_per_commit`` batches.

    Args:
        state: the elastic state.
        batches_per_commit: batches between commits (a commit is a copy of the model, and a check for
            new hosts).
    """

    def __init__(self, state: CommittableState, batches_per_commit: int = 1) -> None:
        super().__init__()
        self.state = state
        self.batches_per_commit = batches_per_commit
        self.batches_remaining = batches_per_commit

    def on_batch_end(self, batch: int, logs: Mapping[str, object] | None = None) -> None:
        self.batches_remaining -= 1
        if self.batches_remaining == 0:
            self.state.commit()
            self.batches_remaining = self.batches_per_commit


class UpdateBatchStateCallback(keras.callbacks.Callback):
    """Keep ``state.batch`` at the last finished batch of the epoch; after a reset, the resumed epoch runs
    only its remaining steps (Horovod's rule: ``steps_per_epoch - state.batch``)."""

    def __init__(self, state: Any) -> None:  # Any: a state whose attributes its constructor's kwargs made
        super().__init__()
        self.state = state
        self.steps_per_epoch: int | None = None

    def on_epoch_begin(self, epoch: int, logs: Mapping[str, object] | None = None) -> None:
        steps = self.params.get("steps") if self.params else None
        if steps:
            if self.steps_per_epoch is None:
                self.steps_per_epoch = steps
            self.params["steps"] = self.steps_per_epoch - self.state.batch

    def on_batch_end(self, batch: int, logs: Mapping[str, object] | None = None) -> None:
        self.state.batch = batch

    def on_epoch_end(self, epoch: int, logs: Mapping[str, object] | None = None) -> None:
        self.state.batch = 0


class UpdateEpochStateCallback(keras.callbacks.Callback):
    """Keep ``state.epoch`` at the next epoch to run (pass ``initial_epoch=state.epoch`` to ``fit``)."""

    def __init__(self, state: Any) -> None:  # Any: a state whose attributes its constructor's kwargs made
        super().__init__()
        self.state = state

    def on_epoch_end(self, epoch: int, logs: Mapping[str, object] | None = None) -> None:
        self.state.epoch = epoch + 1


__all__ = ["CommitStateCallback", "KerasState", "UpdateBatchStateCallback", "UpdateEpochStateCallback", "run"]
