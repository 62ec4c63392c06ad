"""``horovod.spark.common.store`` on phalanx: ``Store``, ``LocalStore``, ``FilesystemStore``, ``HDFSStore``,
``DBFSLocalStore``."""

from __future__ import annotations

from phalanx.spark.estimator.store import DBFSLocalStore, FilesystemStore, HDFSStore, LocalStore, Store

__all__ = ["DBFSLocalStore", "FilesystemStore", "HDFSStore", "LocalStore", "Store"]
