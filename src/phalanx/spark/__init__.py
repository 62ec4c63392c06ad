"""Launch training on Apache Spark: ``HorovodRunner``, ``TorchDistributor`` and ``run`` on barrier mode.

Each rank is one task of a barrier stage; the task starts the rank as a worker process with the same
environment contract and authenticated channel as a local job (see ``docs/spark.md``). pyspark is
imported only when a job runs, so ``import phalanx.spark`` stays cheap.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from phalanx.spark.api import run
    from phalanx.spark.converter import SparkDatasetConverter, make_spark_converter
    from phalanx.spark.deepspeed import DeepspeedTorchDistributor
    from phalanx.spark.distributor import TorchDistributor
    from phalanx.spark.driver_log import log_to_driver
    from phalanx.spark.elastic_run import run_elastic
    from phalanx.spark.runner import HorovodRunner

__all__ = ["DeepspeedTorchDistributor", "HorovodRunner", "SparkDatasetConverter", "TorchDistributor", "log_to_driver",
           "make_spark_converter", "run", "run_elastic"]

_HOMES = {
    "HorovodRunner": "phalanx.spark.runner",
    "TorchDistributor": "phalanx.spark.distributor",
    "DeepspeedTorchDistributor": "phalanx.spark.deepspeed",
    "log_to_driver": "phalanx.spark.driver_log",
    "run": "phalanx.spark.api",
    "run_elastic": "phalanx.spark.elastic_run",
    "make_spark_converter": "phalanx.spark.converter",
    "SparkDatasetConverter": "phalanx.spark.converter",
}


def __getattr__(name: str) -> object:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'phalanx.spark' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(home), name)
