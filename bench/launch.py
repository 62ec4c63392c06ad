"""Launch overhead: a trivial 2-rank job through phalanx.run vs pyspark's TorchDistributor (local mode).

The job: init a gloo process group, one allreduce, return. Both launchers run in this process, side by
side, alternating, median of N runs each. Prints the figures and phalanx's time as a ratio of theirs.

    .venv/bin/python bench/launch.py [--runs 5]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable

import phalanx


def trivial_job() -> float:
    """init, one allreduce, destroy: the smallest real distributed job."""
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    t = torch.ones(1)
    dist.all_reduce(t)
    dist.destroy_process_group()
    return t.item()


def run_phalanx() -> None:
    assert phalanx.run(trivial_job, np=2) == [2.0, 2.0]


def make_torch_distributor() -> Callable[[], None]:
    from pyspark.ml.torch.distributor import TorchDistributor
    from pyspark.sql import SparkSession

    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    SparkSession.builder.master("local[2]").config("spark.ui.enabled", "false").getOrCreate()

    def run() -> None:
        out = TorchDistributor(num_processes=2, local_mode=True, use_gpu=False).run(trivial_job)
        assert out == 2.0, out

    return run


def median_time(fn: Callable[[], None], runs: int) -> tuple[float, list[float]]:
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), times


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    td = make_torch_distributor()
    run_phalanx()  # warm the driver's own imports once for both sides (torch is shared)
    td()
    ours, our_times = median_time(run_phalanx, args.runs)
    theirs, their_times = median_time(td, args.runs)
    print(f"phalanx.run(np=2)                 median {ours:6.2f} s  runs {[round(t, 2) for t in our_times]}")
    print(f"TorchDistributor(local_mode=True) median {theirs:6.2f} s  runs {[round(t, 2) for t in their_times]}")
    print(f"ratio phalanx / TorchDistributor: {ours / theirs:.2f}x  (target <= 0.60x)")


if __name__ == "__main__":
    main()
