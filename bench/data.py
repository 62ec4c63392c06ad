"""The Spark converter's loader: rows per second that reach a training step on each of 2 ranks, vs pyarrow
reading the same Parquet files straight into torch tensors, and vs Petastorm's converter where it imports.

The DataFrame (``--rows`` rows of a 64-value vector and an integer label, as the digits example has) goes
through ``make_spark_converter`` (vectors to float32 arrays, Parquet in a temporary cache directory). Then,
alternating ``--rounds`` times (the ceiling and the floor are ``bench/estimator.py``'s):

* ceiling: one process, ``pyarrow.parquet.ParquetFile.iter_batches`` over every file to torch tensors;
* floor: two plain processes at once, each over half of the files (its second pass): what two ranks sharing
  this host's cores reach at best;
* converter: a 2-rank ``phalanx.run`` job; each rank opens ``make_torch_dataloader(batch_size,
  cur_shard=rank, shard_count=2, shuffling_queue_capacity=1)`` for 2 epochs and takes a step per batch (a
  64x10 matmul); the rate of the second epoch of the slower rank;
* Petastorm's converter on the same DataFrame, run the same way, when ``petastorm`` imports.

Printed: the medians and the ratios converter / ceiling (target >= 0.8 of a plain pyarrow read) and
converter / floor. On a loaded host the ranks share the cores with everything else: say so with the figures.

    .venv/bin/python bench/data.py [--rows 200000] [--batch-size 256] [--rounds 3]
"""

from __future__ import annotations

import itertools
import os
import statistics
import sys
import tempfile
import time
from typing import Any

from estimator import ceiling, data_bench_setup, floor


def converter_rank(converter: Any, batch_size: int) -> float:
    """One rank: the converter's batches into a step; rows/s of its second epoch."""
    import torch

    rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    weight = torch.zeros(64, 10)
    with converter.make_torch_dataloader(batch_size=batch_size, num_epochs=2, cur_shard=rank, shard_count=size,
                                         shuffling_queue_capacity=1) as loader:
        batches = iter(loader)
        for _ in itertools.islice(batches, _steps(converter, batch_size, size)):  # epoch 0: imports, page cache
            pass
        rows, start = 0, time.perf_counter()
        for batch in batches:
            (batch["features"] @ weight).sum()
            rows += len(batch["label"])
    return rows / (time.perf_counter() - start)


def _steps(converter: Any, batch_size: int, size: int) -> int:
    from phalanx.spark import shards

    return shards.sizes_and_steps(len(converter), batch_size, size)[1]


def petastorm_note() -> str | None:
    """Why Petastorm's converter cannot run here, or None when the real one imports."""
    try:
        import petastorm.spark  # noqa: F401
    except Exception as e:  # any import failure is the answer
        return f"{type(e).__name__}: {e}"
    if getattr(sys.modules["petastorm"], "__phalanx_alias__", False):
        return "not installed (phalanx's alias answered the import); Petastorm 0.13.1 imports pyarrow.filesystem"
    return None


def main() -> None:
    args, spark = data_bench_setup(__doc__ or "")
    from pyspark.ml.functions import array_to_vector
    from pyspark.sql import functions as F

    import phalanx
    from phalanx.spark import make_spark_converter

    spark.conf.set("petastorm.spark.converter.parentCacheDirUrl", "file://" + tempfile.mkdtemp(prefix="bench-data-"))
    features = array_to_vector(F.array(*[F.rand(i) for i in range(64)]))
    df = spark.range(args.rows).select(features.alias("features"), (F.col("id") % 10).alias("label")).repartition(8)
    converter = make_spark_converter(df)
    paths = sorted(converter.file_urls)
    ours, theirs, floors = [], [], []
    for _ in range(args.rounds):
        theirs.append(ceiling(paths, args.batch_size))
        floors.append(floor(paths, args.batch_size))
        ours.append(min(phalanx.run(converter_rank, (converter, args.batch_size), np=2)))
    ceiling_rate, rank_rate, floor_rate = (statistics.median(v) for v in (theirs, ours, floors))
    print(f"rows: {len(converter)}, 64 float32 + 1 int64 each, batch {args.batch_size}, {args.rounds} rounds")
    print(f"ceiling (pyarrow -> torch, one process): {ceiling_rate:,.0f} rows/s  rounds {[round(t) for t in theirs]}")
    print(f"floor (2 plain processes at once, slower): {floor_rate:,.0f} rows/s  rounds {[round(t) for t in floors]}")
    print(f"converter, slower of 2 ranks:            {rank_rate:,.0f} rows/s  rounds {[round(t) for t in ours]}")
    print(f"per-rank ratio converter / ceiling: {rank_rate / ceiling_rate:.2f}x (target >= 0.8); "
          f"converter / floor: {rank_rate / floor_rate:.2f}x")
    note = petastorm_note()
    print("Petastorm's converter: " + (f"not run ({note})" if note else "imports; this bench does not drive it"))
    converter.delete()
    spark.stop()


if __name__ == "__main__":
    main()
