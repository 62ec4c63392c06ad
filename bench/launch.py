"""Launch overhead: a trivial 2-rank job through phalanx.run vs pyspark's TorchDistributor (local mode).

The job: init a gloo process group, one allreduce, return. Both launchers run in this process, side by
side, alternating, median of N runs each. Prints the figures and phalanx's time as a ratio of theirs.

    .venv/bin/python bench/launch.py [--runs 5]
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable

from _jobs import median_time

import phalanx


def trivial_job() -> float:
    """init, one allreduce, destroy: the smallest real distributed job (defined here, in __main__, so that
    both launchers send it by value)."""
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    t = torch.ones(1)
    dist.all_reduce(t)
    dist.destroy_process_group()
    return t.item()



def run_phalanx() -> None:
    assert phalanx.run(trivial_job, np=2) == [2.0, 2.0]


def run_phalanx_cold() -> None:
    os.environ["PHALANX_WARM_START"] = "0"
    try:
        run_phalanx()
    finally:
        del os.environ["PHALANX_WARM_START"]


def run_phalanx_warm() -> None:
    from phalanx.launch import warm

    assert warm.ready_template(timeout_s=60) is not None, "warm-start template not ready"
    run_phalanx()


def make_torch_distributor() -> Callable[[], None]:
    from pyspark.ml.torch.distributor import TorchDistributor
    from pyspark.sql import SparkSession

    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    SparkSession.builder.master("local[2]").config("spark.ui.enabled", "false").getOrCreate()

    def run() -> None:
        out = TorchDistributor(num_processes=2, local_mode=True, use_gpu=False).run(trivial_job)
        assert out == 2.0, out

    return run



def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    td = make_torch_distributor()
    run_phalanx_cold()  # warm the driver's own imports once for both sides (torch is shared)
    td()
    cold, cold_times = median_time(run_phalanx_cold, args.runs)
    theirs, their_times = median_time(td, args.runs)
    run_phalanx()  # the first job with warm starts on: cold, then the template starts
    warm_, warm_times = median_time(run_phalanx_warm, args.runs)
    rows = [("phalanx.run(np=2), cold", cold, cold_times), ("phalanx.run(np=2), warm", warm_, warm_times),
            ("TorchDistributor(local_mode=True)", theirs, their_times)]
    for name, med, times in rows:
        print(f"{name:34s} median {med:6.3f} s  runs {[round(t, 3) for t in times]}")
    print(f"ratio cold phalanx / TorchDistributor: {cold / theirs:.3f}x  (target <= 0.60x)")
    print(f"ratio warm phalanx / TorchDistributor: {warm_ / theirs:.3f}x  (target <= 0.05x, <= 250 ms)")


if __name__ == "__main__":
    main()
