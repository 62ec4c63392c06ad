"""Spark launch overhead: a trivial 2-rank job on ``local[2]`` through phalanx.spark vs pyspark's
``TorchDistributor(local_mode=False, use_gpu=False)``, in the same run, on the same SparkSession.

The job: init a gloo process group, one allreduce, return. One warm-up run each (the first Spark stage
pays for JIT and python-worker start-up on both sides), then the two launchers alternate; the median of
N runs each is printed with phalanx's time as a ratio of theirs (target <= 0.25x). phalanx is measured
twice: as a user meets it (ranks forked from the executors' warm-start templates after the first job)
and with every rank a fresh interpreter (``PHALANX_WARM_START=0``, what the first job of a driver pays).

The same two launchers then run on a Spark Connect session (a ``local[2]`` Connect server started in this
process once the classic session is stopped; target <= 0.3x): phalanx's query hosts the job in rank 0's
task, pyspark's hosts torchrun's rendezvous there.

pyspark's TorchDistributor needs pandas and pyarrow (``make bench`` installs them); phalanx does not on a
classic session, and on Connect both need them (``phalanx[connect]``).

    .venv/bin/python bench/spark_launch.py [--runs 5]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

from _jobs import timed


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



def start_spark() -> None:
    from pyspark.sql import SparkSession

    # pyspark's TorchDistributor runs its tasks with PYSPARK_PYTHON; phalanx picks the driver's own.
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    spark = (SparkSession.builder.master("local[2]").config("spark.ui.enabled", "false")
             .config("spark.ui.showConsoleProgress", "false").getOrCreate())
    spark.sparkContext.setLogLevel("ERROR")


def run_phalanx() -> None:
    from phalanx.spark import TorchDistributor

    out = TorchDistributor(num_processes=2, local_mode=False, use_gpu=False).run(trivial_job)
    assert out == 2.0, out


def run_phalanx_cold() -> None:
    from phalanx.spark import run

    # Fresh interpreters on the executors (no warm-start template): the first job of a driver.
    assert run(trivial_job, num_proc=2, env={"PHALANX_WARM_START": "0"}) == [2.0, 2.0]


def run_theirs() -> None:
    from pyspark.ml.torch.distributor import TorchDistributor

    out = TorchDistributor(num_processes=2, local_mode=False, use_gpu=False).run(trivial_job)
    assert out == 2.0, out



def start_connect() -> None:
    """Stop the classic session, start a local[2] Spark Connect server on a free port, connect to it."""
    import socket

    from pyspark.sql import SparkSession
    from pyspark.sql.connect.session import SparkSession as RemoteSession

    active = SparkSession.getActiveSession()
    if active is not None:
        active.stop()
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)  # the server's python workers, both launchers
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # remote("local[2]") would bind the fixed port 15002, which other runs on the machine may hold.
    RemoteSession._start_connect_server("local[2]", {
        "spark.connect.grpc.binding.port": str(port), "spark.ui.enabled": "false",
        "spark.ui.showConsoleProgress": "false", "spark.driver.host": "127.0.0.1"})
    os.environ["SPARK_CONNECT_MODE_ENABLED"] = "1"  # what remote() sets: pyspark's is_remote()
    RemoteSession.builder.remote(f"sc://localhost:{port}").getOrCreate()


def compare(label: str, runs: int, target: float) -> None:
    """Warm up both launchers, then alternate them ``runs`` times; print medians and ratios."""
    warmup = {"phalanx": timed(run_phalanx), "TorchDistributor": timed(run_theirs)}
    ours: list[float] = []
    theirs: list[float] = []
    for _ in range(runs):
        ours.append(timed(run_phalanx))
        theirs.append(timed(run_theirs))
    print(f"{label}: warm-up runs (not counted): {', '.join(f'{k} {v:.2f} s' for k, v in warmup.items())}")
    for name, times in (("phalanx.spark TorchDistributor", ours), ("pyspark TorchDistributor", theirs)):
        print(f"{label}: {name:32s} median {statistics.median(times):6.3f} s  runs {[round(t, 2) for t in times]}")
    ratio = statistics.median(ours) / statistics.median(theirs)
    print(f"{label}: ratio phalanx / pyspark TorchDistributor: {ratio:.3f}x  (target <= {target}x)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--connect-only", action="store_true", help="only the Spark Connect rows")
    args = parser.parse_args()
    if not args.connect_only:
        classic(args.runs)
    start_connect()
    compare("Spark Connect", args.runs, 0.3)


def classic(runs: int) -> None:
    """The classic-session rows: phalanx warm and cold vs pyspark's TorchDistributor."""
    start_spark()
    warmup = {"phalanx": timed(run_phalanx), "TorchDistributor": timed(run_theirs)}
    ours: list[float] = []
    cold: list[float] = []
    theirs: list[float] = []
    for _ in range(runs):
        ours.append(timed(run_phalanx))
        cold.append(timed(run_phalanx_cold))
        theirs.append(timed(run_theirs))
    rows = [("phalanx.spark TorchDistributor", ours), ("phalanx.spark, cold ranks", cold),
            ("pyspark TorchDistributor", theirs)]
    print(f"warm-up runs (not counted): {', '.join(f'{k} {v:.2f} s' for k, v in warmup.items())}")
    for name, times in rows:
        print(f"{name:32s} median {statistics.median(times):6.3f} s  runs {[round(t, 2) for t in times]}")
    for name, times in rows[:2]:
        ratio = statistics.median(times) / statistics.median(theirs)
        print(f"ratio {name} / pyspark TorchDistributor: {ratio:.3f}x  (target <= 0.25x)")


if __name__ == "__main__":
    main()
