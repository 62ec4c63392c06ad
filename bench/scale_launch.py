"""Cold launch at scale: N ranks from a fresh driver, phalanx.run vs torchrun, side by side in one run.

Each measurement starts a new driver process (nothing imported, no warm-start template yet: a cold job),
whose ranks join a gloo process group, allreduce once, then, while every rank is still alive, read their
proportional set size (PSS: shared pages counted once across the processes that share them) and gather it
to rank 0. phalanx: ``python -c 'phalanx.run(job, np=N)'``; torchrun: ``python -m torch.distributed.run
--standalone --nproc-per-node N`` on the same job. Rounds interleaved; medians.

Targets (issue #36): 16 ranks <= 0.25x torchrun's time; phalanx's t(16) / t(2) <= 2.5; the ranks' summed
PSS <= 0.5x torchrun's.

    .venv/bin/python bench/scale_launch.py [--ranks 2,4,8,16] [--rounds 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve()


def job() -> float:
    """One rank: gloo, one allreduce, then every rank's PSS (MB) summed on rank 0 (0.0 elsewhere)."""
    import torch
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group("gloo")
    t = torch.ones(1)
    dist.all_reduce(t)
    pss = torch.tensor([_pss_mb()], dtype=torch.float64)
    dist.all_reduce(pss)  # every rank is alive while the others read theirs: the sharing is counted
    total = float(pss.item()) if dist.get_rank() == 0 else 0.0
    dist.destroy_process_group()
    return total


def _pss_mb() -> float:
    with open("/proc/self/smaps_rollup", encoding="ascii") as f:
        for line in f:
            if line.startswith("Pss:"):
                return int(line.split()[1]) / 1024
    return 0.0


def _phalanx(np: int) -> tuple[float, float]:
    code = ("import sys; sys.path.insert(0, sys.argv[1]); import scale_launch, phalanx; "
            f"print('PSS', phalanx.run(scale_launch.job, np={np})[0])")
    return _timed([sys.executable, "-c", code, str(HERE.parent)])


def _torchrun(np: int) -> tuple[float, float]:
    return _timed([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(np),
                   str(HERE), "--rank"])


def _timed(argv: list[str]) -> tuple[float, float]:
    env = {k: v for k, v in os.environ.items() if k != "PHALANX_WARM_START"}
    env.setdefault("OMP_NUM_THREADS", "1")
    begin = time.perf_counter()
    done = subprocess.run(argv, capture_output=True, text=True, timeout=600, env=env)
    seconds = time.perf_counter() - begin
    if done.returncode != 0:
        raise RuntimeError(f"{argv[:4]} failed:\n{done.stdout[-1500:]}\n{done.stderr[-3000:]}")
    pss = [float(line.split()[-1]) for line in done.stdout.splitlines() if line.startswith("PSS")]
    return seconds, max(pss, default=0.0)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ranks", default="2,4,8,16")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--rank", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.rank:  # a torchrun rank
        total = job()
        if total:
            print("PSS", total, flush=True)
        return 0
    sizes = [int(n) for n in args.ranks.split(",")]
    times: dict[tuple[str, int], list[float]] = {}
    pss: dict[tuple[str, int], list[float]] = {}
    for r in range(args.rounds):
        for np in sizes:
            for who in (("phalanx", "torchrun") if r % 2 == 0 else ("torchrun", "phalanx")):
                seconds, mb = (_phalanx if who == "phalanx" else _torchrun)(np)
                times.setdefault((who, np), []).append(seconds)
                pss.setdefault((who, np), []).append(mb)
    med = {k: statistics.median(v) for k, v in times.items()}
    mem = {k: statistics.median(v) for k, v in pss.items()}
    print("| ranks | phalanx | torchrun | ratio | PSS of all ranks, phalanx / torchrun | PSS ratio |")
    print("|---|---|---|---|---|---|")
    for np in sizes:
        ph, tr = med[("phalanx", np)], med[("torchrun", np)]
        pm, tm = mem[("phalanx", np)], mem[("torchrun", np)]
        print(f"| {np} | {ph:.2f} s | {tr:.2f} s | {ph / tr:.2f}x | {pm:.0f} / {tm:.0f} MB | {pm / tm:.2f}x |")
    lo, hi = min(sizes), max(sizes)
    print(f"phalanx t({hi}) / t({lo}) = {med[('phalanx', hi)] / med[('phalanx', lo)]:.2f} (target <= 2.5); "
          f"torchrun {med[('torchrun', hi)] / med[('torchrun', lo)]:.2f}; targets: {hi} ranks <= 0.25x, "
          f"PSS <= 0.5x; load average {os.getloadavg()[0]:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
