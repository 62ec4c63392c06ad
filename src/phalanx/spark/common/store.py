"""``horovod.spark.common.store`` on phalanx: ``Store``, ``LocalStore``, ``FilesystemStore``."""

from __future__ import annotations

from phalanx.spark.estimator.store import FilesystemStore, LocalStore, Store

__all__ = ["FilesystemStore", "LocalStore", "Store"]
