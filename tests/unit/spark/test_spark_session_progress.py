"""The embedded Spark's start is said on stderr, unless the caller is quiet (``phalanx.spark.run(verbose=0)``)."""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("pyspark")


class _Builder:
    """Stands in for ``SparkSession.builder``: no JVM is started."""

    def master(self, _: str) -> _Builder:
        return self

    def config(self, *_: Any) -> _Builder:
        return self

    def getOrCreate(self) -> Any:
        context = type("Context", (), {"defaultParallelism": 2})()
        return type("Session", (), {"sparkContext": context})()


@pytest.mark.parametrize(("progress", "said"), [(True, True), (False, False)])
def test_an_embedded_spark_start_is_said_unless_quiet(monkeypatch: pytest.MonkeyPatch,
                                                      capsys: pytest.CaptureFixture[str], progress: bool,
                                                      said: bool) -> None:
    from pyspark import SparkContext
    from pyspark.sql import SparkSession

    from phalanx.spark import session

    monkeypatch.setattr(SparkSession, "getActiveSession", staticmethod(lambda: None))
    monkeypatch.setattr(SparkContext, "_active_spark_context", None)
    monkeypatch.setattr(SparkSession, "builder", _Builder())
    monkeypatch.setattr(session, "active_connect_session", lambda: None)
    assert session.spark_target(progress=progress).defaultParallelism == 2
    err = capsys.readouterr().err
    assert ("phalanx: no active SparkSession: starting an embedded Spark local[*]" in err) is said, err
