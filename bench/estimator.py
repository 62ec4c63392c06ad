"""The Spark estimators' data path: rows per second that reach a no-op training step on each rank, vs
pyarrow reading the same Parquet data from local disk straight into torch tensors in one process.

The data (``--rows`` rows of a 64-value vector and an integer label, as the digits example has) is
written into a LocalStore by the estimator's own preparation step (``prepare``: checks, Parquet in the
store). Then, alternating ``--rounds`` times:

* ceiling: one process, ``pyarrow.parquet.ParquetFile.iter_batches`` over every file, each batch's columns
  to NumPy and ``torch.from_numpy``: the practical ceiling of reading the data on this host;
* floor: two plain processes at once (no Spark, no phalanx), each running the ceiling's loop twice over
  half of the files; the rate of the second pass of the slower one. What two ranks sharing this host's
  cores can reach at best per rank, so ``floor / ceiling`` bounds the estimator's ratio here;
* estimator: a 2-rank ``phalanx.spark.run`` job on ``local[2]``; each rank reads its shard through the
  estimator's reader (row groups shared out, shuffled every pass, fixed-size batches) and turns each batch
  into tensors as ``TorchEstimator``'s training loop does; the rate of its second epoch (imports done,
  files cached, as for the ceiling, which reads files just written), of the slower rank.

Printed: the medians, the per-rank ratio estimator / ceiling (target >= 0.8) and the floor's ratio
floor / ceiling (the most the estimator's ratio can be on this host). Both sides run on the
same cores; on a loaded host the ranks share them with everything else (say so with the figures).

    .venv/bin/python bench/estimator.py [--rows 200000] [--batch-size 256] [--rounds 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from typing import Any

from _jobs import slowest_at_once


def ceiling(paths: list[str], batch_size: int) -> float:
    """Rows/s of pyarrow -> NumPy -> torch over every file, one process."""
    import numpy as np
    import pyarrow.parquet as pq
    import torch

    rows = 0
    start = time.perf_counter()
    for path in paths:
        for batch in pq.ParquetFile(path).iter_batches(batch_size=batch_size, columns=["features", "label"]):
            column = batch.column(0)
            x = torch.from_numpy(np.asarray(column.flatten().to_numpy(), np.float32).reshape(len(column), -1))
            y = torch.from_numpy(batch.column(1).to_numpy())
            rows += len(x) if len(y) else 0
    return rows / (time.perf_counter() - start)


def _floor_process(paths: list[str], batch_size: int, barrier: Any, out: Any) -> None:
    import pyarrow.parquet  # noqa: F401 (imported before the clock starts, as in the ceiling's process)
    import torch  # noqa: F401

    barrier.wait()
    ceiling(paths, batch_size)  # the first pass starts both processes together and warms the page cache
    out.put(ceiling(paths, batch_size))


def floor(paths: list[str], batch_size: int, procs: int = 2) -> float:
    """Rows/s of the slower of ``procs`` plain processes running the ceiling's loop at once, each over
    its share of the files (its second pass)."""
    shares = [paths[i::procs] for i in range(procs)]
    return float(slowest_at_once(_floor_process, shares, (batch_size,), timeout_s=600))


def estimator_rank(spec: Any) -> float:
    """One rank: the estimator's batches as tensors, no-op step; rows/s of its second epoch."""
    import os

    import pyarrow.parquet  # noqa: F401 (imported before the clock starts, as in the ceiling's process)
    import torch

    from phalanx.spark.estimator.torch_remote import tensors

    rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    rates = []
    for epoch in range(2):  # the first epoch also warms the page cache for the rank's files
        rows = 0
        start = time.perf_counter()
        for batch in spec.batches(rank, size, epoch, validation=False):
            x = tensors(batch, spec.data.features, None, torch.device("cpu"))
            y = tensors(batch, spec.data.labels, None, torch.device("cpu"))
            rows += len(x[0]) if len(y[0]) else 0
        rates.append(rows / (time.perf_counter() - start))
    return rates[-1]


def prepare_data(spark: Any, rows: int, batch_size: int) -> Any:
    from pyspark.sql import functions as F

    from phalanx.spark.estimator.job import TrainSpec
    from phalanx.spark.estimator.prepare import prepare
    from phalanx.spark.estimator.store import LocalStore

    df = spark.range(rows).select(F.array(*[F.rand(i).cast("float") for i in range(64)]).alias("features"),
                                  (F.col("id") % 10).alias("label"))
    store = LocalStore(tempfile.mkdtemp(prefix="bench-estimator-"))
    params = {"feature_cols": ["features"], "label_cols": ["label"], "partitions_per_process": 4,
              "batch_size": batch_size, "shuffle": True, "random_seed": 0}
    data = prepare(df, store, "bench", params, 2)
    return TrainSpec(b"", data, store, "bench", params)


def data_bench_setup(description: str, shuffle: bool = False) -> tuple[argparse.Namespace, Any]:
    """The data benches' arguments (``--rows``, ``--batch-size``, ``--rounds``, with ``shuffle`` also
    ``--shuffle``) and a ``local[2]`` session."""
    parser = argparse.ArgumentParser(description=description.split("\n")[0])
    parser.add_argument("--rows", type=int, default=200_000)
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=3)
    if shuffle:
        parser.add_argument("--shuffle", type=int, default=0, help="shuffling_queue_capacity (0: none)")
    args = parser.parse_args()
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    from pyspark.sql import SparkSession

    spark = (SparkSession.builder.master("local[2]").config("spark.ui.enabled", "false")
             .config("spark.ui.showConsoleProgress", "false").getOrCreate())
    spark.sparkContext.setLogLevel("ERROR")
    return args, spark


def main() -> None:
    args, spark = data_bench_setup(__doc__ or "")
    import phalanx.spark

    spec = prepare_data(spark, args.rows, args.batch_size)
    paths = sorted({p.path for p in spec.data.train})
    ours, theirs, floors = [], [], []
    for _ in range(args.rounds):
        theirs.append(ceiling(paths, args.batch_size))
        floors.append(floor(paths, args.batch_size))
        ours.append(min(phalanx.spark.run(estimator_rank, args=(spec,), num_proc=2, verbose=0)))
    ceiling_rate, rank_rate = statistics.median(theirs), statistics.median(ours)
    floor_rate = statistics.median(floors)
    print(f"rows: {spec.data.train_rows}, 64 float32 + 1 int64 each, batch {args.batch_size}, {args.rounds} rounds")
    print(f"ceiling (pyarrow -> torch, one process): {ceiling_rate:,.0f} rows/s  rounds {[round(t) for t in theirs]}")
    print(f"floor (2 plain processes at once, slower): {floor_rate:,.0f} rows/s  rounds {[round(t) for t in floors]}")
    print(f"estimator data path, slower of 2 ranks:  {rank_rate:,.0f} rows/s  rounds {[round(t) for t in ours]}")
    print(f"per-rank ratio estimator / ceiling: {rank_rate / ceiling_rate:.2f}x (target >= 0.8)")
    print(f"floor / ceiling (the most 2 ranks reach on this host): {floor_rate / ceiling_rate:.2f}x; "
          f"estimator / floor: {rank_rate / floor_rate:.2f}x")
    spark.stop()


if __name__ == "__main__":
    main()
