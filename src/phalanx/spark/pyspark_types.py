"""Typed interfaces of the pyspark objects phalanx.spark touches: what each caller uses of them, so a
signature says it (instead of ``Any``) and mypy checks the calls without importing pyspark.

pyspark is imported only where a job runs; these Protocols hold for classic pyspark and for Spark Connect's
objects alike where both are accepted (a Connect session has no SparkContext).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol, TypeAlias

if TYPE_CHECKING:
    import pyspark
    import pyspark.sql
    from pyspark.sql.connect.session import SparkSession as ConnectSession


class SparkConfLike(Protocol):
    """``pyspark.SparkConf``: the settings a SparkContext was started with."""

    def get(self, key: str) -> str | None: ...


class SparkContextLike(Protocol):
    """``pyspark.SparkContext``, classic Spark only."""

    @property
    def master(self) -> str | None: ...

    def getConf(self) -> SparkConfLike: ...


class RuntimeConfLike(Protocol):
    """``SparkSession.conf`` (``pyspark.sql.conf.RuntimeConfig``, classic or Connect)."""

    def get(self, key: str, default: str | None = ...) -> str | None: ...


class SessionLike(Protocol):
    """A ``SparkSession`` seen through its settings (on Connect, all phalanx reads of the cluster)."""

    @property
    def conf(self) -> RuntimeConfLike: ...


#: What the GPU and slot checks accept: a classic SparkContext or a Spark Connect session.
ContextOrSession: TypeAlias = "SparkContextLike | ConnectSession"
#: Where a job runs: the classic SparkContext, or the Spark Connect session (which has none).
SparkTarget: TypeAlias = "pyspark.SparkContext | ConnectSession"


if TYPE_CHECKING:

    def _pyspark_conforms(conf: pyspark.SparkConf, sc: pyspark.SparkContext, classic: pyspark.sql.SparkSession,
                          connect: ConnectSession) -> None:
        """pyspark's own classes satisfy these interfaces (checked by mypy against pyspark's annotations)."""
        checked: tuple[SparkConfLike, SparkContextLike, SessionLike, SessionLike] = (conf, sc, classic, connect)
        del checked
