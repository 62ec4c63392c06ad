"""``horovod.spark.keras`` on phalanx: ``KerasEstimator`` and ``KerasModel`` (see docs/estimators.md)."""

from __future__ import annotations

from phalanx.spark.estimator.keras import KerasEstimator, KerasModel
from phalanx.spark.estimator.store import FilesystemStore, LocalStore, Store

__all__ = ["FilesystemStore", "KerasEstimator", "KerasModel", "LocalStore", "Store"]
