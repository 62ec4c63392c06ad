"""A driver's first and second Spark job, one rank per task: phalanx.spark vs pyspark's TorchDistributor, side by
side in one run.

Each measurement is a fresh driver process: it starts a SparkSession on ``--master`` (default ``local[4]``: one
executor, four task slots), starts the executor's python workers with a trivial stage (not timed: both launchers
need them), then times its first and second job of ``--np`` ranks (init gloo, one allreduce), one rank per
barrier task. phalanx forks its ranks from one warm template per executor, which the first job's first task
starts (one import of torch for the executor's tasks and for every later job); TorchDistributor runs torchrun
in every task. ``--no-reuse`` sets ``spark.python.worker.reuse=false`` (every task a fresh python worker, as
some clusters run). ``--before-src DIR`` adds phalanx from another source tree (``DIR`` on ``PYTHONPATH``, e.g.
an export of an earlier commit) to the rotation. Launchers interleaved, medians.

    .venv/bin/python bench/spark_first_jobs.py [--master local[4]] [--np 4] [--rounds 2] [--no-reuse]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve()


def trivial_job() -> float:
    """init, one allreduce, destroy (defined in ``__main__``, so that both launchers send it by value)."""
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    t = torch.ones(1)
    dist.all_reduce(t)
    dist.destroy_process_group()
    return t.item()


def _session(master: str, reuse: bool) -> Any:
    from pyspark.sql import SparkSession

    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    spark = (SparkSession.builder.master(master).config("spark.ui.enabled", "false")
             .config("spark.ui.showConsoleProgress", "false").config("spark.pyspark.python", sys.executable)
             .config("spark.python.worker.reuse", str(reuse).lower()).getOrCreate())
    spark.sparkContext.setLogLevel("ERROR")
    return spark


def _job(launcher: str, np: int) -> None:
    if launcher == "theirs":
        from pyspark.ml.torch.distributor import TorchDistributor as Theirs

        assert Theirs(num_processes=np, local_mode=False, use_gpu=False).run(trivial_job) == float(np)
    else:
        from phalanx.spark import TorchDistributor

        assert TorchDistributor(num_processes=np, local_mode=False, use_gpu=False).run(trivial_job) == float(np)


def child(launcher: str, master: str, np: int, reuse: bool) -> None:
    """One driver: its first and second job's seconds, as JSON on stdout."""
    spark = _session(master, reuse)
    sc = spark.sparkContext
    sc.parallelize(range(np), np).barrier().mapPartitions(lambda it: [0]).collect()  # the python workers
    times = []
    for _ in range(2):
        start = time.perf_counter()
        _job(launcher, np)
        times.append(time.perf_counter() - start)
    templates = _templates()
    spark.stop()
    print("TIMES " + json.dumps(times), flush=True)
    print("TEMPLATES " + json.dumps(templates), flush=True)


def _templates() -> dict[str, int]:
    """This driver's warm templates running now (each imported torch once): per executor (owned by one of this
    process's descendants, its executors' pyspark daemons) and per python worker (descendants themselves)."""
    from phalanx.launch.proctree import descendants

    mine = {str(p) for p in descendants(os.getpid())}
    found = {"per executor": 0, "per python worker": 0}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
        except OSError:
            continue
        if "phalanx.worker.template_shared" in argv:  # ... template_shared FD OWNER ...
            found["per executor"] += argv[argv.index("phalanx.worker.template_shared") + 2] in mine
        elif "phalanx.worker.template" in argv:
            found["per python worker"] += pid in mine
    return found


def _measure(launcher: str, args: argparse.Namespace) -> tuple[list[float], str]:
    env = dict(os.environ)
    if launcher == "before":
        env["PYTHONPATH"] = os.pathsep.join(p for p in (args.before_src, env.get("PYTHONPATH", "")) if p)
    argv = [sys.executable, str(HERE), "--child", "theirs" if launcher == "theirs" else "phalanx",
            "--master", args.master, "--np", str(args.np), *([] if args.reuse else ["--no-reuse"])]
    out = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=900, check=False)
    lines = [line for line in out.stdout.splitlines() if line.startswith("TIMES ")]
    if out.returncode != 0 or not lines:
        raise SystemExit(f"{launcher} failed ({out.returncode}):\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
    templates = [line[10:] for line in out.stdout.splitlines() if line.startswith("TEMPLATES ")]
    return [float(t) for t in json.loads(lines[-1][6:])], templates[-1] if templates else ""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--master", default="local[4]")
    parser.add_argument("--np", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--no-reuse", dest="reuse", action="store_false")
    parser.add_argument("--before-src", default="")
    parser.add_argument("--child", default="")
    args = parser.parse_args()
    if args.child:
        child(args.child, args.master, args.np, args.reuse)
        return
    launchers = ["phalanx", "theirs", *(["before"] if args.before_src else [])]
    runs: dict[str, list[list[float]]] = {name: [] for name in launchers}
    for r in range(args.rounds):
        for name in launchers if r % 2 == 0 else reversed(launchers):
            times, templates = _measure(name, args)
            runs[name].append(times)
            print(f"round {r + 1} {name}: first {times[0]:.2f} s, second {times[1]:.2f} s; templates after the "
                  f"jobs: {templates}", flush=True)
    med = {name: [statistics.median(t[i] for t in runs[name]) for i in range(2)] for name in launchers}
    print(f"\n{args.master}, {args.np} ranks (one per task), python worker reuse {args.reuse}, "
          f"medians of {args.rounds}:")
    for name in launchers:
        ratio = " / ".join(f"{m / t:.2f}x" for m, t in zip(med[name], med["theirs"], strict=True))
        print(f"  {name:8s} first {med[name][0]:.2f} s, second {med[name][1]:.2f} s   vs theirs {ratio}")


if __name__ == "__main__":
    main()
