"""Timeline cost: training steps/s with the timeline off, on (rank 0 writes) and on for every rank.

One ``phalanx.run`` job at np=2 trains the models of phalanx.torch's training benchmark (``bench/train.py``:
an 824k-parameter CNN and a 5.8M-parameter MLP) with ``hvd.DistributedOptimizer``. Inside it the three modes
alternate in short blocks of steps, the order rotating every round, so a change in machine load hits all
modes alike; each round gives a paired ratio (mode vs off in the same round) and the median of those
ratios is the figure. Two measures:

- wall: rank 0's steps/s (the issue's "training throughput"), sensitive to other load on the machine;
- cpu: CPU seconds per step of both ranks' processes, all threads included (the timeline's writer thread
  too): the work the timeline adds, robust when other jobs share the machine.

Also prints the cost of the "off" check per operation times the operations per step, which bounds the
cost of the instrumentation when the timeline is off.

    .venv/bin/python bench/timeline.py [--rounds 12] [--steps 4]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from typing import Any

import phalanx

MODES = ("off", "on", "all_ranks")
Block = tuple[float, float, float]  # wall s, process CPU s, timeline writer thread CPU s: one block of steps


def _training_models() -> dict[str, tuple[Any, tuple[int, ...]]]:
    """phalanx.torch's training benchmark models (bench/train.py), shipped to the workers by value."""
    import cloudpickle

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import train

    cloudpickle.register_pickle_by_value(train)
    return dict(train.MODELS)


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
    tl = timeline.current()
    timeline.stop_timeline()
    return wall, cpu, tl.writer_cpu_s if tl is not None else 0.0


def _bench_hooks(model: Any) -> Any:
    """Stand-in instrumentation, used only while phalanx.torch records nothing itself.

    Per parameter and step: a QUEUE pair when its gradient is ready, an ALLREDUCE from then until
    ``step()`` returns, and one WAIT_FOR_DATA around ``step()``; the args phalanx.torch would pass. That is
    2 events per parameter tensor plus 1 per step - more than fused buckets would produce.
    Returns ``finish(timeline)``, to call after ``optimizer.step()``.
    """
    from phalanx import timeline as phalanx_timeline

    params = list(model.named_parameters())

    def hook_for(name: str, args: dict[str, object]) -> Any:
        def hook(_: Any) -> None:
            tl = phalanx_timeline.current()
            if tl is not None:
                tl.begin(name, phalanx_timeline.QUEUE, args)
                tl.end(name, phalanx_timeline.QUEUE)
                tl.begin(name, phalanx_timeline.ALLREDUCE, args)

        return hook

    for name, p in params:
        args = {"dtype": str(p.dtype), "shape": tuple(p.shape), "bytes": p.numel() * p.element_size()}
        p.register_post_accumulate_grad_hook(hook_for(name, args))

    def finish(tl: Any) -> None:
        for name, _ in params:
            tl.end(name, phalanx_timeline.ALLREDUCE)

    return finish


def _torch_records(step: Any, trace: str) -> bool:
    """Whether phalanx.torch writes timeline events itself (one probe step, every rank records)."""
    from phalanx import timeline
    from phalanx.timeline.reader import load_trace

    tl = timeline.start_timeline(trace, all_ranks=True)
    step()
    timeline.stop_timeline()
    return any("bench.sync" not in s.row for s in load_trace([tl.path]).spans)


def _train_one(make: Any, shape: tuple[int, ...], rounds: int, steps: int, trace_dir: str) -> dict[str, Any]:
    import torch

    import phalanx.torch as hvd
    from phalanx import timeline

    torch.manual_seed(0)
    model = make()
    sgd = torch.optim.SGD(model.parameters(), lr=0.01)
    opt = hvd.DistributedOptimizer(sgd, named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    x, y = torch.randn(*shape), torch.randint(0, 10, (shape[0],))
    loss_fn = torch.nn.CrossEntropyLoss()
    finish = None

    def step() -> None:
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        tl = timeline.current()
        if tl is not None and finish is not None:
            tl.begin("optimizer", timeline.WAIT_FOR_DATA)
        opt.step()
        if tl is not None and finish is not None:
            tl.end("optimizer", timeline.WAIT_FOR_DATA)
            finish(tl)

    for _ in range(3):
        step()
    native = _torch_records(step, os.path.join(trace_dir, "probe.json"))
    if not native:
        finish = _bench_hooks(model)
    blocks: dict[str, list[Block]] = {m: [] for m in MODES}
    for r in range(rounds):
        for mode in MODES[r % 3 :] + MODES[: r % 3]:
            blocks[mode].append(_timed_block(step, steps, mode, os.path.join(trace_dir, f"{mode}.json")))
    return {"blocks": blocks, "native": native, "pair_us": _pair_cpu_us(os.path.join(trace_dir, "micro.json"))}


def _pair_cpu_us(trace: str, n: int = 20_000) -> float:
    """CPU microseconds the training thread spends in one begin/end pair (typical args)."""
    from phalanx import timeline
    from phalanx.timeline.writer import Timeline

    tl = Timeline(trace)
    args = {"dtype": "torch.float32", "shape": (2048, 2048), "bytes": 16777216}
    t0 = time.thread_time()
    for _ in range(n):
        tl.begin("grad", timeline.ALLREDUCE, args)
        tl.end("grad", timeline.ALLREDUCE)
    per_pair = (time.thread_time() - t0) / n * 1e6
    tl.close()
    return per_pair


def train(models: dict[str, Any], rounds: int, steps: int, trace_dir: str) -> dict[str, dict[str, Any]]:
    """One rank of the benchmark: per model, per mode one (wall, cpu) block per round, and who recorded."""
    import phalanx.torch as hvd

    hvd.init()
    out = {}
    for name, (make, shape) in models.items():
        out[name] = _train_one(make, shape, rounds, steps, os.path.join(trace_dir, name))
    hvd.shutdown()
    return out


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
    """Per mode: medians of steps/s (rank 0), CPU per step (both ranks), writer CPU per step (rank 0),
    and the medians of the per-round ratios against "off"."""
    rank0 = per_rank[0]
    rounds = range(len(rank0["off"]))
    cpu = {m: [sum(r[m][i][1] for r in per_rank) / steps for i in rounds] for m in MODES}
    out: dict[str, dict[str, float]] = {}
    for m in MODES:
        out[m] = {
            "rate": statistics.median(steps / b[0] for b in rank0[m]),
            "cpu_ms": 1000 * statistics.median(cpu[m]),
            "writer_ms": 1000 * statistics.median(b[2] / steps for b in rank0[m]),
            "wall_ratio": statistics.median(o[0] / b[0] for b, o in zip(rank0[m], rank0["off"])),
            "cpu_ratio": statistics.median(c / o for c, o in zip(cpu[m], cpu["off"])),
        }
    return out


def report(fig: dict[str, dict[str, float]], ops: float, trace_kb: float, pair_us: float, off_ns: float) -> None:
    """Print one model's figures: end to end (paired, noisy under load) and accounted (direct CPU time)."""
    for m in MODES:
        f = fig[m]
        print(f"    {m:<10} {f['rate']:7.2f} steps/s (rank 0)   {f['cpu_ms']:7.2f} ms CPU per step (both ranks)")
    for m in MODES[1:]:
        f = fig[m]
        print(
            f"    {m + ' / off':<15} throughput x{f['wall_ratio']:.3f} ({100 * (1 - f['wall_ratio']):+.1f}% cost), "
            f"CPU per step x{f['cpu_ratio']:.3f} ({100 * (f['cpu_ratio'] - 1):+.1f}%)"
        )
    step_ms = 1e3 / fig["off"]["rate"]
    record_ms = ops * pair_us / 1000
    added = fig["on"]["writer_ms"] + record_ms
    print(f"    trace: {ops:.1f} operations per step, {trace_kb:.2f} kB per step (rank 0's file)")
    print(
        f"    accounted, rank 0 on: writer thread {fig['on']['writer_ms']:.3f} ms + recording {record_ms:.3f} ms "
        f"({pair_us:.2f} us per begin/end) = {added:.3f} ms CPU per step = {100 * added / step_ms:.2f}% of a "
        f"{step_ms:.1f} ms step"
    )
    print(
        f"    off: {off_ns:.0f} ns per check x {ops:.1f} ops per step = {off_ns * ops / 1000:.2f} us per step "
        f"({100 * off_ns * ops / 1e6 / step_ms:.4f}%)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--steps", type=int, default=4)
    ns = parser.parse_args()
    models = _training_models()
    with tempfile.TemporaryDirectory() as trace_dir:
        for name in models:
            os.makedirs(os.path.join(trace_dir, name))
        t0 = time.perf_counter()
        per_rank = phalanx.run(train, args=(models, ns.rounds, ns.steps, trace_dir), np=2)
        wall = time.perf_counter() - t0
        traces = {name: os.path.join(trace_dir, name, "on.json") for name in models}
        ops = {name: ops_per_step(path, ns.steps) for name, path in traces.items()}
        sizes = {name: os.path.getsize(path) / 1024 / ns.steps for name, path in traces.items()}
    off_ns = off_check_ns()
    print(
        f"timeline bench: np=2, bench/train.py models + DistributedOptimizer, {ns.rounds} paired rounds x "
        f"{ns.steps} steps per mode, {wall:.0f} s; ratios are medians of per-round ratios"
    )
    for name in models:
        native = per_rank[0][name]["native"]
        source = "phalanx.torch" if native else "the bench's stand-in hooks (phalanx.torch records no events yet)"
        print(f"  model {name}: events recorded by {source}")
        fig = paired([r[name]["blocks"] for r in per_rank], ns.steps)
        report(fig, ops[name], sizes[name], per_rank[0][name]["pair_us"], off_ns)


if __name__ == "__main__":
    main()
