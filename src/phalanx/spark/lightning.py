"""``horovod.spark.lightning`` on phalanx: ``TorchEstimator`` for a ``LightningModule`` (docs/estimators.md)."""

from __future__ import annotations

from phalanx.spark.estimator.lightning import TorchEstimator
from phalanx.spark.estimator.store import FilesystemStore, LocalStore, Store
from phalanx.spark.estimator.torch import TorchModel

__all__ = ["FilesystemStore", "LocalStore", "Store", "TorchEstimator", "TorchModel"]
