"""Typed interfaces of the pyspark objects phalanx.spark touches: what each caller uses of them, so a
signature says it (instead of ``Any``) and mypy checks the calls without importing pyspark.

pyspark is imported only where a job runs; these Protocols hold for classic pyspark and for Spark Connect's
objects alike where both are accepted (a Connect session has no SparkContext).
"""

from __future__ import annotations

from typing import Protocol


class SparkConfLike(Protocol):
    """``pyspark.SparkConf``: the settings a SparkContext was started with."""

    def get(self, key: str, defaultValue: str | None = None) -> str | None: ...


class SparkContextLike(Protocol):
    """``pyspark.SparkContext``, classic Spark only."""

    @property
    def master(self) -> str: ...

    def getConf(self) -> SparkConfLike: ...


class RuntimeConfLike(Protocol):
    """``SparkSession.conf`` (``pyspark.sql.conf.RuntimeConfig``, classic or Connect)."""

    def get(self, key: str, default: str | None = None) -> str | None: ...


class SessionLike(Protocol):
    """A ``SparkSession`` seen through its settings (on Connect, all phalanx reads of the cluster)."""

    @property
    def conf(self) -> RuntimeConfLike: ...


#: What the GPU and slot checks accept: a classic SparkContext or a Spark Connect session.
ContextOrSession = SparkContextLike | SessionLike
