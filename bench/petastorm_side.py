"""bench/data.py's competitor: Petastorm's own converter, run in ``.venv-petastorm`` (Petastorm 0.13.1 needs
pyarrow < 15, so it cannot import beside phalanx's pyarrow).

Started by bench/data.py as ``.venv-petastorm/bin/python bench/petastorm_side.py PARQUET_URL BATCH_SIZE SHUFFLE
FILES``: it reads the Parquet data phalanx's converter wrote as a DataFrame of ``FILES`` partitions (phalanx's file
count: Spark would merge small files), converts it with Petastorm's
``make_spark_converter`` (its own cache, the same row-group size), stops Spark and prints ``ready ROWS``. Then,
for each ``round`` line on stdin, it runs two spawned processes at once, each opening
``make_torch_dataloader(batch_size, num_epochs=None, cur_shard=rank, shard_count=2,
shuffling_queue_capacity=SHUFFLE)``
with the environment phalanx gives a rank here (``OMP_NUM_THREADS=1``), and prints one JSON line: each rank's
rows/s and rows per CPU-second of its third epoch's worth of steps (Spark's partitions of the re-read data
need not be even, so a rank's epoch may be a step shorter: without end, no rank runs out). ``quit`` deletes
the cache and exits.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import queue
import shutil
import sys
import tempfile
import time
from typing import Any

RANKS = 2
WARM_EPOCHS = 2  # as bench/data.py's


def petastorm_rank(converter: Any, rank: int, batch_size: int, shuffle: int, barrier: Any, out: Any) -> None:
    """One rank: Petastorm's batches into the same step as phalanx's ranks take."""
    os.environ.update(OMP_NUM_THREADS="1", RANK=str(rank), WORLD_SIZE=str(RANKS))
    import torch

    weight = torch.zeros(64, 10)
    steps = -(-len(converter) // RANKS // batch_size)
    barrier.wait()
    with converter.make_torch_dataloader(batch_size=batch_size, num_epochs=None, cur_shard=rank,
                                         shard_count=RANKS, shuffling_queue_capacity=shuffle) as loader:
        batches = iter(loader)
        for _ in range(WARM_EPOCHS * steps):  # imports, page cache, the reader's pool, torch's first steps
            (next(batches)["features"] @ weight).sum()
        rows, start, cpu = 0, time.perf_counter(), time.process_time()
        for _ in range(steps):
            batch = next(batches)
            (batch["features"] @ weight).sum()
            rows += len(batch["label"])
    wall, cpu = time.perf_counter() - start, time.process_time() - cpu
    out.put((rank, rows / wall, rows / cpu))


def one_round(converter: Any, batch_size: int, shuffle: int) -> list[list[float]]:
    ctx = multiprocessing.get_context("spawn")
    barrier, out = ctx.Barrier(RANKS), ctx.Queue()
    procs = [ctx.Process(target=petastorm_rank, args=(converter, r, batch_size, shuffle, barrier, out))
             for r in range(RANKS)]
    for p in procs:
        p.start()
    results = []
    while len(results) < RANKS:
        try:
            results.append(out.get(timeout=5))
        except queue.Empty:
            dead = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
            if dead:
                raise RuntimeError(f"a Petastorm rank exited with {dead[0]} (its traceback is above)") from None
    for p in procs:
        p.join(timeout=60)
    results.sort()
    return [[wall, cpu] for _, wall, cpu in results]


def main() -> None:
    url, batch_size, shuffle, files = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    from petastorm.spark import SparkDatasetConverter, make_spark_converter
    from pyspark.sql import SparkSession

    spark = (SparkSession.builder.master("local[2]").config("spark.ui.enabled", "false")
             .config("spark.ui.showConsoleProgress", "false").getOrCreate())
    spark.sparkContext.setLogLevel("ERROR")
    parent = tempfile.mkdtemp(prefix="bench-petastorm-")
    spark.conf.set(SparkDatasetConverter.PARENT_CACHE_DIR_URL_CONF, "file://" + parent)
    converter = make_spark_converter(spark.read.parquet(url).repartition(files))
    spark.stop()
    print(f"ready {len(converter)}", flush=True)
    for line in sys.stdin:
        if line.strip() != "round":
            break
        print(json.dumps(one_round(converter, batch_size, shuffle)), flush=True)
    converter.delete()
    shutil.rmtree(parent, ignore_errors=True)


if __name__ == "__main__":
    main()
