"""The Spark converter's loader: rows per second that reach a training step on each of 2 ranks, vs plain
pyarrow reads of the same Parquet files in processes like a rank's, and vs Petastorm's own converter.

The DataFrame (``--rows`` rows of a 64-value vector and an integer label, as the digits example has) goes
through ``make_spark_converter`` (vectors to float32 arrays, Parquet in a temporary cache directory, 8 files
of one row group each). Spark is then stopped, and alternating ``--rounds`` times:

* floor: two plain processes at once (no phalanx), each reading half of the files with
  ``ParquetFile.iter_batches`` into torch tensors and the same step per batch, three times; the third pass is
  timed (a fresh process's first few hundred steps cost several times a warm one's). Variants: the
  environment phalanx gives a rank on this host (``OMP_NUM_THREADS=1``, which also sizes pyarrow's CPU
  pool), pyarrow's CPU pool at the host's cores, pyarrow on one CPU and one I/O thread, and no
  ``OMP_NUM_THREADS`` at all (torch's step then runs on every core);
* converter: a 2-rank ``phalanx.run`` job; each rank opens ``make_torch_dataloader(batch_size,
  cur_shard=rank, shard_count=2, shuffling_queue_capacity=--shuffle)`` without end and takes a step per batch
  (a 64x10 matmul). After two epochs and two plain passes (the floor's loop over the rank's half of the
  files), it times ``PAIRS`` pairs of one converter epoch and one plain pass, alternating which goes first:
  both sides in the same process, moments apart, so under the same load;
* Petastorm 0.13.1's converter on the same data (``bench/petastorm_side.py`` in ``.venv-petastorm``, which
  ``make bench`` builds: Petastorm needs pyarrow < 15), two spawned ranks, each timing its third epoch.

``--shuffle`` (default 0: row groups shuffled, rows in file order) is the shuffling queue capacity of both
converters: above 0 phalanx permutes the rows of each row group, Petastorm draws rows at random from a
buffer of that many rows (Petastorm 0.13.1 fails with a capacity of 1: ``ValueError: high <= 0``).

Each side reports the slower rank's rows/s (wall clock) and rows per CPU-second of that process (all its
threads). On a loaded host a process gets a fraction of a core that changes from second to second, so the
wall-clock rates of two runs differ by more than the loaders do; the CPU rate measures what a loader costs
per row, whatever the scheduler gave it, though it too falls as contention grows. The floor processes and
the converter's job run seconds apart, when the load may differ severalfold; the pairs inside the ranks do
not. Printed: the medians, and the medians of each round's ratios (for the pairs, of every pair's ratio).

    .venv/bin/python bench/data.py [--rows 200000] [--batch-size 256] [--rounds 3] [--shuffle 0]
"""

from __future__ import annotations

import itertools
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _jobs import slowest_at_once
from estimator import data_bench_setup

PETASTORM_PYTHON = Path(__file__).resolve().parent.parent / ".venv-petastorm" / "bin" / "python"
#: The floor's variants: the environment, and pyarrow's CPU pool size (None: as Arrow sizes it, which follows
#: OMP_NUM_THREADS) with its I/O pool (None: Arrow's default of 8).
FLOORS = {"rank env (OMP_NUM_THREADS=1)": ({"OMP_NUM_THREADS": "1"}, None, None),
          "OMP_NUM_THREADS=1, pyarrow cpu_count=cores": ({"OMP_NUM_THREADS": "1"}, os.cpu_count() or 1, None),
          "OMP_NUM_THREADS=1, pyarrow 1 cpu + 1 io thread": ({"OMP_NUM_THREADS": "1"}, 1, 1),
          "no OMP_NUM_THREADS (torch's step on 2 threads)": ({}, None, None)}
Rate = tuple[float, float]  # rows/s, rows per CPU-second
#: Passes before the timed one: a fresh process's first few hundred steps cost several times a warm one's.
WARM_EPOCHS = 2
#: Timed pairs (a converter epoch and a plain pass) in each converter rank.
PAIRS = 3


def step(batch: dict[str, Any], weight: Any) -> None:
    """The training step every side takes per batch (a 64x10 matmul)."""
    (batch["features"] @ weight).sum()


def plain_pass(paths: list[str], batch_size: int) -> int:
    """pyarrow -> NumPy -> torch over ``paths`` (the ceiling's loop of bench/estimator.py), a step per batch;
    the rows read."""
    import numpy as np
    import pyarrow.parquet as pq
    import torch

    weight = torch.zeros(64, 10)
    rows = 0
    for path in paths:
        for batch in pq.ParquetFile(path).iter_batches(batch_size=batch_size, columns=["features", "label"]):
            column = batch.column(0)
            x = torch.from_numpy(np.asarray(column.flatten().to_numpy(), np.float32).reshape(len(column), -1))
            y = torch.from_numpy(batch.column(1).to_numpy())
            step({"features": x, "label": y}, weight)
            rows += len(x)
    return rows


def _plain_process(paths: list[str], batch_size: int, env: dict[str, str], cpus: int | None, io: int | None,
                   barrier: Any, out: Any) -> None:
    os.environ.update(env)
    import warnings

    import pyarrow
    import torch  # noqa: F401 (imported before the clock starts, as in a rank)

    warnings.filterwarnings("ignore", "The given NumPy array is not writable")
    if cpus is not None:
        pyarrow.set_cpu_count(cpus)
    if io is not None:
        pyarrow.set_io_thread_count(io)
    barrier.wait()
    for _ in range(WARM_EPOCHS):  # starts both processes together; warms the page cache and torch's first steps
        plain_pass(paths, batch_size)
    start, cpu = time.perf_counter(), time.process_time()
    rows = plain_pass(paths, batch_size)
    out.put((rows / (time.perf_counter() - start), rows / (time.process_time() - cpu)))


def floor(paths: list[str], batch_size: int, env: dict[str, str], cpus: int | None, io: int | None,
          procs: int = 2) -> Rate:
    """The slower of ``procs`` plain processes reading their share of the files at once."""
    shares = [paths[i::procs] for i in range(procs)]
    rate: Rate = slowest_at_once(_plain_process, shares, (batch_size, env, cpus, io), timeout_s=900)
    return rate


def converter_rank(converter: Any, batch_size: int, shuffle: int) -> list[tuple[Rate, Rate]]:
    """One rank: ``PAIRS`` pairs of (a converter epoch into a step, a plain pass over the rank's half of the
    files), after warming both; each side's rows/s and rows/CPU-s."""
    import warnings

    import torch

    warnings.filterwarnings("ignore", "The given NumPy array is not writable")  # the plain pass's, as in floor
    rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    weight = torch.zeros(64, 10)
    steps, paths = _steps(converter, batch_size, size), sorted(converter.file_urls)[rank::size]
    with converter.make_torch_dataloader(batch_size=batch_size, num_epochs=None, cur_shard=rank, shard_count=size,
                                         shuffling_queue_capacity=shuffle) as loader:
        batches = iter(loader)

        def epoch() -> int:
            rows = 0
            for batch in itertools.islice(batches, steps):
                step(batch, weight)
                rows += len(batch["label"])
            return rows

        def plain() -> int:
            return plain_pass(paths, batch_size)

        for _ in range(WARM_EPOCHS):
            epoch(), plain()
        pairs = []
        for i in range(PAIRS):
            first, second = (epoch, plain) if i % 2 == 0 else (plain, epoch)
            rates = {first: _timed(first), second: _timed(second)}
            pairs.append((rates[epoch], rates[plain]))
    return pairs


def _timed(fn: Any) -> Rate:
    start, cpu = time.perf_counter(), time.process_time()
    rows = fn()
    return rows / (time.perf_counter() - start), rows / (time.process_time() - cpu)


def _steps(converter: Any, batch_size: int, size: int) -> int:
    from phalanx.spark import shards

    return shards.sizes_and_steps(len(converter), batch_size, size)[1]


class Petastorm:
    """Petastorm's converter in ``.venv-petastorm`` (bench/petastorm_side.py), one round per call."""

    def __init__(self, url: str, batch_size: int, shuffle: int, files: int) -> None:
        side = str(Path(__file__).with_name("petastorm_side.py"))
        argv = [str(PETASTORM_PYTHON), "-W", "ignore", side, url, str(batch_size), str(shuffle), str(files)]
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.rows = int(self._line().split()[1])

    def _line(self) -> str:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"bench/petastorm_side.py exited with {self.proc.wait()} (its stderr is above)")
        return line

    def round(self) -> Rate:
        assert self.proc.stdin is not None
        self.proc.stdin.write("round\n")
        self.proc.stdin.flush()
        return min(tuple(r) for r in json.loads(self._line()))  # type: ignore[return-value]

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write("quit\n")
        self.proc.stdin.close()
        self.proc.wait(timeout=120)


def _median(rates: list[Rate]) -> Rate:
    return statistics.median(r[0] for r in rates), statistics.median(r[1] for r in rates)


def _ratio(a: list[Rate], b: list[Rate]) -> str:
    wall = statistics.median(x[0] / y[0] for x, y in zip(a, b))
    cpu = statistics.median(x[1] / y[1] for x, y in zip(a, b))
    return f"wall {wall:.2f}x, per CPU-second {cpu:.2f}x"


def _row(name: str, rates: list[Rate]) -> str:
    wall, cpu = _median(rates)
    return (f"{name:42s} {wall:>11,.0f} rows/s {cpu:>11,.0f} rows/CPU-s  "
            f"rounds {[round(r[0]) for r in rates]}")


def main() -> None:
    args, spark = data_bench_setup(__doc__ or "", shuffle=True)
    from pyspark.ml.functions import array_to_vector
    from pyspark.sql import functions as F

    import phalanx
    from phalanx.spark import make_spark_converter

    parent = tempfile.mkdtemp(prefix="bench-data-")
    spark.conf.set("petastorm.spark.converter.parentCacheDirUrl", "file://" + parent)
    features = array_to_vector(F.array(*[F.rand(i) for i in range(64)]))
    df = spark.range(args.rows).select(features.alias("features"), (F.col("id") % 10).alias("label")).repartition(8)
    converter = make_spark_converter(df)
    spark.stop()  # the JVM would share the cores with both sides
    paths = sorted(converter.file_urls)
    petastorm = None
    if PETASTORM_PYTHON.exists():
        petastorm = Petastorm(converter.cache_dir_url, args.batch_size, args.shuffle, len(paths))
    floors: dict[str, list[Rate]] = {name: [] for name in FLOORS}
    ours, theirs, paired, pairs = [], [], [], []  # type: list[Rate], list[Rate], list[Rate], list[tuple[Rate, Rate]]
    for _ in range(args.rounds):
        for name, (env, cpus, io) in FLOORS.items():
            floors[name].append(floor(paths, args.batch_size, env, cpus, io))
        ranks = phalanx.run(converter_rank, (converter, args.batch_size, args.shuffle), np=2)
        ours.append(min(_median([loader for loader, _ in rank]) for rank in ranks))
        paired.append(min(_median([plain for _, plain in rank]) for rank in ranks))
        pairs += [pair for rank in ranks for pair in rank]
        if petastorm is not None:
            theirs.append(petastorm.round())
    print(f"rows: {len(converter)}, 64 float32 + 1 int64 each, {len(paths)} files, batch {args.batch_size}, "
          f"shuffle {args.shuffle}, {args.rounds} rounds; the slower of 2 processes at once")
    for name, rates in floors.items():
        print(_row(f"plain pyarrow, {name}", rates))
    print(_row("phalanx converter (2-rank phalanx.run)", ours))
    print(_row("plain pyarrow, paired in the converter's ranks", paired))
    rank_floor = floors[next(iter(FLOORS))]
    print(f"phalanx / plain pyarrow paired in the same ranks ({len(pairs)} pairs): "
          f"{_ratio([a for a, _ in pairs], [b for _, b in pairs])}  (target >= 0.8)")
    print(f"phalanx / plain pyarrow processes (rank env), timed seconds apart: {_ratio(ours, rank_floor)}")
    if petastorm is None:
        print(f"Petastorm's converter: not run ({PETASTORM_PYTHON} is missing: make .venv-petastorm/.installed)")
    else:
        print(_row("Petastorm 0.13.1 converter (2 ranks)", theirs))
        print(f"phalanx / Petastorm: {_ratio(ours, theirs)}  (target >= 1.5)")
        print(f"Petastorm / plain pyarrow (rank env): {_ratio(theirs, rank_floor)}")
        petastorm.close()
    converter.delete()
    shutil.rmtree(parent, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
