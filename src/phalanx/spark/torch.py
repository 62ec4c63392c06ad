"""``horovod.spark.torch`` on phalanx: ``TorchEstimator`` and ``TorchModel`` (see docs/estimators.md)."""

from __future__ import annotations

from phalanx.spark.estimator.store import FilesystemStore, LocalStore, Store
from phalanx.spark.estimator.torch import TorchEstimator, TorchModel

__all__ = ["FilesystemStore", "LocalStore", "Store", "TorchEstimator", "TorchModel"]
