"""Horovod's Spark estimators on phalanx (``phalanx.spark.torch`` / ``.keras`` / ``.lightning``).

Modules: ``params`` (Horovod's parameters), ``store`` (where a run lives), ``schema`` (column checks),
``prepare`` (DataFrame -> Parquet in the store, on the driver), ``reader`` (a rank's shard, pyarrow),
``job`` (what each rank receives), ``base`` (``fit``), ``model`` / ``transform`` (the fitted ``Model``),
and one estimator and one rank-side trainer per framework. See docs/estimators.md.
"""
