"""Horovod's Spark estimators for Keras and Lightning on the digits DataFrame (the smaller twins of
``spark_estimator_digits.py``).

``--framework keras``: ``KerasEstimator`` with the Keras CNN of ``_digits`` (inputs reshaped to the model's
``(8, 8, 1)``). ``--framework lightning``: Lightning's ``TorchEstimator`` with a ``LightningModule`` whose
steps take Horovod's Lightning batch format, a dict ``column -> tensor``. Both fit on ``--np`` ranks,
transform the held-out rows on the executors and print the accuracy. Nothing is downloaded.

    .venv/bin/python examples/spark_estimator_keras_lightning.py --framework keras [--np 2] [--epochs 3]
"""

from __future__ import annotations

import argparse
import tempfile
from typing import Any


def _module_class() -> Any:
    import lightning as L
    import torch
    import torch.nn.functional as F
    from _digits import make_model

    class DigitsModule(L.LightningModule):
        """The digits CNN; each batch is ``{"features": (B, 1, 8, 8), "label": (B,)}``."""

        def __init__(self) -> None:
            super().__init__()
            self.net = make_model()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.net(x)

        def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
            loss = F.cross_entropy(self(batch["features"]), batch["label"])
            self.log("loss", loss, sync_dist=True)
            return loss

        def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
            self.log("val_loss", F.cross_entropy(self(batch["features"]), batch["label"]), sync_dist=True)

        def configure_optimizers(self) -> Any:
            return torch.optim.Adam(self.parameters(), lr=2e-3)

    return DigitsModule


def keras_estimator(args: argparse.Namespace, store: Any) -> Any:
    """A KerasEstimator for the digits."""
    from _digits import make_keras_model
    from tensorflow import keras  # the Keras TensorFlow chose: Keras 3, or tf_keras under TF_USE_LEGACY_KERAS=1

    from phalanx.spark.keras import KerasEstimator  # or: from horovod.spark.keras import KerasEstimator

    keras.utils.set_random_seed(0)
    return KerasEstimator(num_proc=args.np, model=make_keras_model(), optimizer=keras.optimizers.Adam(2e-3),
                          loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                          feature_cols=["features"], label_cols=["label"], batch_size=32, epochs=args.epochs,
                          validation=0.1, random_seed=0, store=store)


def lightning_estimator(args: argparse.Namespace, store: Any) -> Any:
    """Lightning's TorchEstimator for the digits."""
    import torch

    from phalanx.spark.lightning import TorchEstimator  # or: from horovod.spark.lightning import ...

    torch.manual_seed(0)
    return TorchEstimator(num_proc=args.np, model=_module_class()(), feature_cols=["features"],
                          label_cols=["label"], input_shapes=[[-1, 1, 8, 8]], batch_size=32, epochs=args.epochs,
                          validation=0.1, random_seed=0, store=store)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Fit, transform the held-out rows; print and return ``{"accuracy", "history"}``."""
    from pyspark.sql import SparkSession
    from spark_estimator_digits import accuracy, digits_frames

    from phalanx.spark.torch import LocalStore

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--framework", choices=["keras", "lightning"], default="keras")
    parser.add_argument("--np", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=3)
    args = parser.parse_args(argv)
    train_df, test_df = digits_frames(SparkSession.builder.getOrCreate())
    store = LocalStore(tempfile.mkdtemp(prefix=f"digits-{args.framework}-"))
    build = keras_estimator if args.framework == "keras" else lightning_estimator
    trained = build(args, store).fit(train_df)
    test_accuracy = accuracy(trained.transform(test_df))
    print(f"{args.framework}: held-out accuracy {test_accuracy:.3f}; last epoch {trained.getHistory()[-1]}")
    return {"accuracy": test_accuracy, "history": trained.getHistory()}


if __name__ == "__main__":
    main()
