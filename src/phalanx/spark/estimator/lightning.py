"""Lightning's ``TorchEstimator`` and ``TorchModel``: Horovod's ``horovod.spark.lightning`` on phalanx.

The model is a ``LightningModule``; its ``training_step(batch, batch_idx)`` (and ``validation_step``)
receive Horovod's batch format, a dict ``column name -> tensor`` (features shaped by ``input_shapes``), and
its ``configure_optimizers`` gives the optimizer. Every rank runs one ``Trainer.fit`` with phalanx's
``HorovodStrategy`` (``strategy="horovod"``: ``hvd.DistributedOptimizer``, learning rate scaled by the
number of ranks, as Horovod's strategy does).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from phalanx.errors import InvalidArgumentError
from phalanx.spark.estimator.base import PhalanxEstimator, pickled
from phalanx.spark.estimator.job import TrainResult, TrainSpec
from phalanx.spark.estimator.lightning_remote import flavour_of
from phalanx.spark.estimator.params import add_params
from phalanx.spark.estimator.torch import TorchModel, trained_model

#: Horovod's name for the oldest Lightning its estimator supports; here the oldest the estimator is tested
#: with (the ``lightning>=2.2`` of pyproject's dev extra).
MIN_PL_VERSION = "2.2.0"

LIGHTNING_PARAMS: dict[str, tuple[object, str]] = {
    "input_shapes": (None, "shape of each input, the batch dimension first as -1"),
    "trainer_args": ({}, "ignored: phalanx builds the Trainer (epochs, steps, strategy)"),
    "logger": (None, "ignored: metrics go to the history and the store's logs"),
    "terminate_on_nan": (False, "stop training with a ValueError when the loss or a parameter is NaN or inf"),
    "profiler": (None, "the Trainer's profiler (a Lightning Profiler or its name: 'simple', 'advanced'...)"),
}



class TorchEstimator(PhalanxEstimator):
    """Spark ML ``Estimator`` that trains a ``LightningModule`` on a DataFrame (``horovod.spark.lightning``).

    ``TorchEstimator(model=module, feature_cols=[...], label_cols=[...], input_shapes=[...], batch_size=32,
    epochs=1, store=..., num_proc=...).fit(df)`` returns a :class:`TorchModel`.
    """

    framework = "lightning"

    @classmethod
    def extra_params(cls) -> dict[str, tuple[object, str]]:
        """``input_shapes``, ``trainer_args``, ``logger``, ``terminate_on_nan``, ``profiler``."""
        return LIGHTNING_PARAMS

    def check_framework(self, values: dict[str, Any]) -> None:
        """``model`` a ``LightningModule`` of either flavour (``lightning`` or ``pytorch_lightning``)."""
        if flavour_of(values["model"]) is None:
            raise InvalidArgumentError(
                f"model={type(values['model']).__name__}: give a LightningModule (lightning.LightningModule or "
                "pytorch_lightning.LightningModule; pip install lightning)")

    def model_blob(self, values: dict[str, Any]) -> bytes:
        """The module, pickled."""
        return pickled(values["model"], "the LightningModule")

    def remote(self) -> Callable[[TrainSpec], TrainResult]:
        """``lightning_remote.train``."""
        from phalanx.spark.estimator.lightning_remote import train

        return train

    def make_model(self, result: TrainResult, spec: TrainSpec) -> TorchModel:
        """A :class:`TorchModel` holding a copy of the module with the trained weights."""
        return trained_model(self.getOrDefault("model"), result, spec)


add_params(TorchEstimator, LIGHTNING_PARAMS)
