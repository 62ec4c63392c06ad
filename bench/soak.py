"""Elastic soak: N elastic jobs, each losing one rank to SIGKILL at a random step; count what survived.

Each job trains the tests' digits MLP (``tests/multiprocess/elastic/_digits_job.py``) on 2 ranks for
``--steps`` steps, committing every ``--commit-every``; a random rank SIGKILLs itself at a random step.
Prints, per job and in total: completed / failed, the steps replayed (work lost), the accuracy against an
undisturbed run, the wall time; and checks that no worker process is left behind.

    .venv/bin/python bench/soak.py [--jobs 20] [--seed S] [--spark]

``--spark`` runs every job with ``phalanx.spark.run_elastic`` on an embedded ``local[*]`` Spark session
(no checkpoint directory: a job completes only if its barrier stage survived the kill, the victim being
replaced in its own task while the other rank keeps its work).
"""

from __future__ import annotations

import argparse
import io
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "multiprocess" / "elastic"))

import _digits_job as job

import phalanx
from phalanx.env import names as env_names


def leftover_workers() -> list[int]:
    """Live processes that carry an elastic worker id (none should survive a job)."""
    found = []
    marker = f"{env_names.PHALANX_ELASTIC_WORKER_ID}=".encode()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if marker in (entry / "environ").read_bytes():
                found.append(int(entry.name))
        except OSError:
            continue
    return found


def one_job(data: Any, args: argparse.Namespace, rng: random.Random, folder: str) -> dict[str, Any]:
    """Run one elastic job with a random kill; return its outcome."""
    kill_at, victim = rng.randrange(1, args.steps - 1), rng.randrange(args.np)
    kwargs = {"steps": args.steps, "commit_every": args.commit_every, "kill_at": kill_at, "victim": victim,
              "marker": os.path.join(folder, f"killed.{time.monotonic_ns()}")}
    started = time.perf_counter()
    env = {env_names.PHALANX_ELASTIC_TIMEOUT_S: "30"}
    try:
        if args.spark:
            from phalanx.spark import run_elastic

            out = run_elastic(job.train, (data,), kwargs, num_proc=args.np, min_np=1, reset_limit=3, env=env,
                              stdout=io.StringIO(), stderr=io.StringIO())
        else:
            out = phalanx.run(job.train, (data,), kwargs, np=args.np, min_np=1, reset_limit=3, env=env,
                              prefix_output=False)
    except Exception as e:  # a failed job is a data point here, not a crash of the soak
        return {"ok": False, "kill_at": kill_at, "victim": victim, "error": f"{type(e).__name__}: {e}"[:300],
                "seconds": time.perf_counter() - started}
    return {"ok": True, "kill_at": kill_at, "victim": victim, "acc": out[0]["acc"],
            "lost": max(r["executed"] for r in out) - args.steps, "seconds": time.perf_counter() - started}


def undisturbed(data: Any, args: argparse.Namespace) -> float:
    """Rank 0's accuracy after a run without a kill."""
    kwargs = {"steps": args.steps, "commit_every": args.commit_every}
    if args.spark:
        from phalanx.spark import run

        return float(run(job.train, (data,), kwargs, num_proc=args.np, stdout=io.StringIO())[0]["acc"])
    return float(phalanx.run(job.train, (data,), kwargs, np=args.np, prefix_output=False)[0]["acc"])


def main() -> None:
    """Run the soak and print the summary."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--jobs", type=int, default=20)
    p.add_argument("--np", type=int, default=2)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--commit-every", type=int, default=5)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--spark", action="store_true", help="run the jobs with phalanx.spark.run_elastic")
    args = p.parse_args()
    seed = args.seed if args.seed is not None else random.randrange(2**31)
    rng = random.Random(seed)
    data = job.load_data()
    base, base_s = 0.0, 0.0
    for _ in range(2):  # the second run is warm, like the soak's jobs
        started = time.perf_counter()
        base = undisturbed(data, args)
        base_s = time.perf_counter() - started
    print(f"soak seed {seed}{' (Spark, local[*])' if args.spark else ''}: {args.jobs} jobs x {args.np} ranks, "
          f"{args.steps} steps, commit every "
          f"{args.commit_every}; undisturbed: accuracy {base:.2f}%, {base_s:.1f} s")
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        for i in range(args.jobs):
            row = one_job(data, args, rng, folder)
            rows.append(row)
            detail = (f"lost {row['lost']} steps, acc {row['acc']:.2f}% ({row['acc'] - base:+.2f})" if row["ok"]
                      else row["error"])
            print(f"job {i:2d}: kill rank {row['victim']} at step {row['kill_at']:2d}: "
                  f"{'completed' if row['ok'] else 'FAILED'} in {row['seconds']:.1f} s; {detail}", flush=True)
    summarize(rows, base, args.commit_every)


def summarize(rows: list[dict[str, Any]], base: float, commit_every: int) -> None:
    """Print completed / failed, work lost and accuracy spread, and leftover processes."""
    done = [r for r in rows if r["ok"]]
    lost = [r["lost"] for r in done]
    print(f"completed {len(done)}/{len(rows)}, failed {len(rows) - len(done)}")
    if done:
        worst_acc = max(abs(r["acc"] - base) for r in done)
        print(f"work lost (steps replayed): total {sum(lost)}, mean {statistics.mean(lost):.2f}, max {max(lost)} "
              f"(commit interval {commit_every}); max |accuracy - undisturbed| {worst_acc:.2f} points; "
              f"median job {statistics.median(r['seconds'] for r in done):.1f} s")
    print(f"leftover worker processes: {len(leftover_workers())}")


if __name__ == "__main__":
    main()
