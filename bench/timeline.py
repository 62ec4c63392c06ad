"""Timeline cost: training steps/s with the timeline off, on (rank 0 writes) and on for every rank.

One ``phalanx.run`` job at np=2 trains an MLP with ``hvd.DistributedOptimizer``. Inside it the three modes
alternate in short blocks of steps, the order rotating every round, so a change in machine load hits all
modes alike; each round gives a paired ratio (mode vs off in the same round) and the median of those
ratios is the figure. Two measures:

- wall: rank 0's steps/s (the issue's "training throughput"), sensitive to other load on the machine;
- cpu: CPU seconds per step of both ranks' processes, all threads included (the timeline's writer thread
  too): the work the timeline adds, robust when other jobs share the machine.

Also prints the cost of the "off" check per operation times the operations per step, which bounds the
cost of the instrumentation when the timeline is off.

    .venv/bin/python bench/timeline.py [--rounds 30] [--steps 8]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from typing import Any

import phalanx

MODES = ("off", "on", "all_ranks")
Block = tuple[float, float]  # (wall seconds, process CPU seconds) for one block of steps


def _model() -> Any:
    import torch

    layers: list[torch.nn.Module] = []
    for _ in range(6):
        layers += [torch.nn.Linear(512, 512), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers, torch.nn.Linear(512, 10))


def _timed_block(step: Any, steps: int, mode: str, trace: str) -> Block:
    import torch

    import phalanx.torch as hvd
    from phalanx import timeline

    if mode != "off":
        timeline.start_timeline(trace, all_ranks=mode == "all_ranks")
    hvd.allreduce(torch.zeros(1), name="bench.sync")  # every rank starts the block together
    t0, c0 = time.perf_counter(), time.process_time()
    for _ in range(steps):
        step()
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    timeline.stop_timeline()
    return wall, cpu


def train(rounds: int, steps: int, trace_dir: str) -> dict[str, list[Block]]:
    """One rank of the benchmark: per mode, one (wall, cpu) block per round."""
    import torch
    import torch.nn.functional as F

    import phalanx.torch as hvd

    hvd.init()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = _model()
    sgd = torch.optim.SGD(model.parameters(), lr=0.01)
    opt = hvd.DistributedOptimizer(sgd, named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    x, y = torch.randn(64, 512), torch.randn(64, 10)

    def step() -> None:
        opt.zero_grad()
        F.mse_loss(model(x), y).backward()
        opt.step()

    for _ in range(10):
        step()
    blocks: dict[str, list[Block]] = {m: [] for m in MODES}
    for r in range(rounds):
        for mode in MODES[r % 3 :] + MODES[: r % 3]:
            blocks[mode].append(_timed_block(step, steps, mode, os.path.join(trace_dir, f"{mode}.json")))
    hvd.shutdown()
    return blocks


def off_check_ns(n: int = 200_000) -> float:
    """Nanoseconds instrumented code pays per operation when the timeline is off."""
    from phalanx import timeline

    t0 = time.perf_counter_ns()
    for _ in range(n):
        tl = timeline.current()
        if tl is not None:
            tl.begin("x", timeline.ALLREDUCE)
    return (time.perf_counter_ns() - t0) / n


def ops_per_step(trace: str, steps: int) -> float:
    """Operations recorded per training step in the last "on" block."""
    from phalanx.timeline.reader import load_trace

    spans = [s for s in load_trace([trace]).spans if "bench.sync" not in s.row]
    return len(spans) / steps


def paired(per_rank: list[dict[str, list[Block]]], steps: int) -> dict[str, dict[str, float]]:
    """Per mode: median steps/s (rank 0, wall), median CPU s per step (both ranks), and median paired ratios."""
    rank0 = per_rank[0]
    cpu = {m: [sum(r[m][i][1] for r in per_rank) / steps for i in range(len(rank0[m]))] for m in MODES}
    out: dict[str, dict[str, float]] = {}
    for m in MODES:
        rate = [steps / wall for wall, _ in rank0[m]]
        out[m] = {
            "rate": statistics.median(rate),
            "cpu_ms": 1000 * statistics.median(cpu[m]),
            "wall_ratio": statistics.median(steps / w / (steps / o) for (w, _), (o, _) in zip(rank0[m], rank0["off"])),
            "cpu_ratio": statistics.median(c / o for c, o in zip(cpu[m], cpu["off"])),
        }
    return out


def report(fig: dict[str, dict[str, float]], rounds: int, steps: int, wall: float) -> None:
    print(
        f"timeline bench: np=2, MLP 6x512 + DistributedOptimizer, {rounds} rounds x {steps} steps per mode, "
        f"{wall:.0f} s"
    )
    for m in MODES:
        f = fig[m]
        print(f"  {m:<10} {f['rate']:7.2f} steps/s (rank 0)   {f['cpu_ms']:7.2f} ms CPU per step (both ranks)")
    for m in MODES[1:]:
        f = fig[m]
        print(
            f"  {m + ' / off':<15} throughput x{f['wall_ratio']:.3f} ({100 * (1 - f['wall_ratio']):+.1f}% cost), "
            f"CPU per step x{f['cpu_ratio']:.3f} ({100 * (f['cpu_ratio'] - 1):+.1f}%)   [median of paired rounds]"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--steps", type=int, default=8)
    ns = parser.parse_args()
    with tempfile.TemporaryDirectory() as trace_dir:
        t0 = time.perf_counter()
        per_rank = phalanx.run(train, args=(ns.rounds, ns.steps, trace_dir), np=2)
        wall = time.perf_counter() - t0
        ops = ops_per_step(os.path.join(trace_dir, "on.json"), ns.steps)
        trace_kb = os.path.getsize(os.path.join(trace_dir, "on.json")) / 1024
    fig = paired(per_rank, ns.steps)
    report(fig, ns.rounds, ns.steps, wall)
    check = off_check_ns()
    step_us = 1e6 / fig["off"]["rate"]
    print(f"  trace: {ops:.1f} operations per step, {trace_kb / ns.steps:.2f} kB per step (rank 0's file)")
    print(
        f"  off: {check:.0f} ns per check x {ops:.1f} ops per step = {check * ops / 1000:.2f} us of a "
        f"{step_us:.0f} us step ({100 * check * ops / 1000 / step_us:.3f}%)"
    )


if __name__ == "__main__":
    main()
