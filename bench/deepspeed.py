"""DeepSpeed on Spark: phalanx's DeepspeedTorchDistributor vs pyspark's, on the same ``local[2]`` session.

The job: a ZeRO-2 step loop on a ~20M-parameter MLP, 2 ranks (``numGpus=1, nnodes=2, localMode=False,
useGpu=False``), CPU and gloo, ``torch_adam``; the config is a dict that both distributors hand to the ranks as
``--deepspeed_config``, and the function reads it with ``deepspeed.add_config_arguments`` as users do. Each
run reports two figures from rank 0:

- **launch**: seconds from ``run()`` to the first line of the function on rank 0 (the driver and the ranks
  share this host's clock), target <= 0.5x pyspark's;
- **steps/s**: ZeRO-2 steps per second over the timed steps, after warm-up steps, target >= 0.98x.

One warm-up run each (the first Spark stage pays for python-worker start-up on both sides), then the two
distributors alternate; medians of N runs each and their ratios are printed. pyspark's distributor needs
pandas and pyarrow (``make bench`` installs them).

    .venv/bin/python bench/deepspeed.py [--runs 3] [--steps 10]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

HIDDEN, WIDTH, BATCH = 4864, 1024, 8
CONFIG: dict[str, Any] = {
    "train_micro_batch_size_per_gpu": BATCH,
    "optimizer": {"type": "Adam", "params": {"lr": 1e-4, "torch_adam": True}},
    "zero_optimization": {"stage": 2}, "steps_per_print": 10**6,
}


def zero2_steps(warmup: int, steps: int) -> dict[str, float]:
    """Rank's work: ZeRO-2 on the MLP; returns when the function started and the steps per second (defined
    here, in __main__, so that both distributors send it by value)."""
    started = time.time()
    import argparse as ap

    import deepspeed
    import torch

    flags, _ = deepspeed.add_config_arguments(ap.ArgumentParser()).parse_known_args(sys.argv[1:])
    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(WIDTH, HIDDEN), torch.nn.ReLU(), torch.nn.Linear(HIDDEN, WIDTH),
                                torch.nn.ReLU(), torch.nn.Linear(WIDTH, HIDDEN), torch.nn.ReLU(),
                                torch.nn.Linear(HIDDEN, WIDTH))
    engine, _, _, _ = deepspeed.initialize(args=flags, model=model, model_parameters=model.parameters())
    x = torch.randn(BATCH, WIDTH)
    t0 = 0.0
    for step in range(warmup + steps):
        if step == warmup:
            t0 = time.perf_counter()
        loss = engine(x).pow(2).mean()
        engine.backward(loss)
        engine.step()
    rate = steps / (time.perf_counter() - t0)
    engine.destroy()
    return {"started": started, "steps_per_s": rate, "params": float(sum(p.numel() for p in model.parameters()))}


def start_spark() -> None:
    from pyspark.sql import SparkSession

    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)  # pyspark's tasks run PYSPARK_PYTHON
    spark = (SparkSession.builder.master("local[2]").config("spark.ui.enabled", "false")
             .config("spark.ui.showConsoleProgress", "false").getOrCreate())
    spark.sparkContext.setLogLevel("ERROR")


def distributor(kind: str) -> Any:
    if kind == "phalanx":
        from phalanx.spark import DeepspeedTorchDistributor
    else:
        from pyspark.ml.deepspeed.deepspeed_distributor import DeepspeedTorchDistributor  # type: ignore[no-redef]
    return DeepspeedTorchDistributor(numGpus=1, nnodes=2, localMode=False, useGpu=False, deepspeedConfig=CONFIG)


def one_run(kind: str, warmup: int, steps: int) -> tuple[float, float]:
    """(launch seconds, steps/s) of one job. pyspark's job is run once more if it fails: its torchrun can lose
    the rendezvous port it picked to another process (EADDRINUSE), and DeepSpeed's shm op can abort a rank at
    exit; neither is phalanx's, and neither should end the run. phalanx's failures end it."""
    for attempt in (1, 2):
        d = distributor(kind)
        t0 = time.time()
        try:
            out = d.run(zero2_steps, warmup, steps)
        except Exception as e:
            if kind == "phalanx" or attempt == 2:
                raise
            print(f"pyspark DeepspeedTorchDistributor failed ({type(e).__name__}); this run again, not counted")
            continue
        return out["started"] - t0, out["steps_per_s"]
    raise AssertionError("unreachable")


def report(label: str, fmt: Callable[[float], str], ours: list[float], theirs: list[float], target: str) -> None:
    for name, values in (("phalanx DeepspeedTorchDistributor", ours), ("pyspark DeepspeedTorchDistributor", theirs)):
        print(f"{label}: {name:34s} median {fmt(statistics.median(values))}  runs {[round(v, 3) for v in values]}")
    ratio = statistics.median(ours) / statistics.median(theirs)
    print(f"{label}: ratio phalanx / pyspark: {ratio:.3f}x  (target {target})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--warmup-steps", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()
    start_spark()
    for kind in ("phalanx", "pyspark"):
        launch, rate = one_run(kind, args.warmup_steps, args.steps)
        print(f"warm-up run (not counted): {kind} launch {launch:.2f} s, {rate:.2f} steps/s")
    launches: dict[str, list[float]] = {"phalanx": [], "pyspark": []}
    rates: dict[str, list[float]] = {"phalanx": [], "pyspark": []}
    for r in range(args.runs):
        # The order alternates: a load that falls (or rises) during the run must not favour the side run second.
        for kind in ("phalanx", "pyspark") if r % 2 == 0 else ("pyspark", "phalanx"):
            launch, rate = one_run(kind, args.warmup_steps, args.steps)
            launches[kind].append(launch)
            rates[kind].append(rate)
    report("launch", lambda v: f"{v:6.2f} s", launches["phalanx"], launches["pyspark"], "<= 0.5x")
    report("ZeRO-2 steps/s", lambda v: f"{v:6.2f}", rates["phalanx"], rates["pyspark"], ">= 0.98x")


if __name__ == "__main__":
    main()
