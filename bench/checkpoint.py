"""Training stall per checkpoint of a ~200 MB model on 2 ranks: phalanx's asynchronous sharded save vs
rank 0's ``torch.save`` of the gathered model, to the same local disk.

The model is an FSDP2 (``fully_shard``) stack of ``--layers`` 2048x2048 linear layers (``--layers 12``:
50 M parameters, 201 MB in float32), trained with SGD on 2 ranks. Each side runs ``--steps`` steps and
checkpoints at every ``--every``-th step; the stall is (time of the run with checkpoints - time of the same
run without) / checkpoints, on the slower rank:

* torch.save: ``get_model_state_dict(full_state_dict=True, cpu_offload=True)`` (the gather every rank must
  join) and rank 0's ``torch.save`` to a file, flushed, while rank 1 waits at the next step's collective;
* phalanx: ``Checkpointer.save(step, {"app": TrainState(model)}, async_save=True)``: each rank copies its
  shard to CPU memory and returns; the files are written by a background thread while training goes on.

Printed: each side's stall per checkpoint and the ratio phalanx / torch.save (target <= 0.2x). Both run on
the same 2 cores; on a loaded host the figures move with the load (say so with them).

    .venv/bin/python bench/checkpoint.py [--layers 12] [--steps 12] [--every 4] [--rounds 2]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from typing import Any


def train(mode: str, layers: int, steps: int, every: int, folder: str) -> tuple[float, float]:
    """One rank: ``steps`` FSDP2 steps, checkpointing per ``mode`` (none, torch_save, phalanx); the run's
    seconds and the seconds spent inside the checkpoint calls."""
    import torch
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.fsdp import fully_shard

    import phalanx.torch as hvd
    from phalanx.torch.checkpoint import Checkpointer, TrainState

    hvd.init()
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(2048, 2048, bias=False) for _ in range(layers)])
    fully_shard(model)
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    ckpt = Checkpointer(os.path.join(folder, "dcp"), keep_last=1) if mode == "phalanx" else None
    x = torch.randn(8, 2048)
    dist.barrier()
    start, in_calls = time.perf_counter(), 0.0
    for step in range(1, steps + 1):
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()
        if step % every or mode == "none":
            continue
        called = time.perf_counter()
        if ckpt is not None:
            ckpt.save(step, {"app": TrainState(model)}, async_save=True)
        else:
            full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
            if hvd.rank() == 0:
                with open(os.path.join(folder, "model.pt"), "wb") as f:
                    torch.save(full, f)
                    f.flush()
                    os.fsync(f.fileno())
        in_calls += time.perf_counter() - called
    dist.barrier()
    elapsed = time.perf_counter() - start
    if ckpt is not None:
        ckpt.close()
    return elapsed, in_calls


def run(mode: str, args: Any) -> tuple[float, float]:
    """The slower rank's run time, and the most time a rank spent inside the checkpoint calls."""
    import phalanx

    folder = tempfile.mkdtemp(prefix="bench-ckpt-")
    try:
        ranks = phalanx.run(train, (mode, args.layers, args.steps, args.every, folder), np=2)
        return max(r[0] for r in ranks), max(r[1] for r in ranks)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--every", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    times: dict[str, list[float]] = {"none": [], "torch_save": [], "phalanx": []}
    calls: dict[str, list[float]] = {mode: [] for mode in times}
    for _ in range(args.rounds):  # interleaved, so a change of load touches every side
        for mode in times:
            elapsed, in_calls = run(mode, args)
            times[mode].append(elapsed)
            calls[mode].append(in_calls)
    base = statistics.median(times["none"])
    saves = args.steps // args.every
    stall = {m: (statistics.median(t) - base) / saves for m, t in times.items() if m != "none"}
    print(f"model: {args.layers} x 2048x2048 float32 = {args.layers * 2048 * 2048 * 4 / 1e6:.0f} MB, FSDP2 on 2 ranks; "
          f"{args.steps} steps, a checkpoint every {args.every} ({saves}), {args.rounds} rounds")
    for mode, values in times.items():
        inside = statistics.median(calls[mode]) / saves
        print(f"{mode:>10}: {statistics.median(values):.2f} s  rounds {[round(v, 2) for v in values]}; "
              f"inside the call {inside:.2f} s per checkpoint")
    print(f"stall per checkpoint: torch.save {stall['torch_save']:.2f} s, phalanx async sharded "
          f"{stall['phalanx']:.2f} s; ratio {stall['phalanx'] / stall['torch_save']:.2f}x (target <= 0.2x)")


if __name__ == "__main__":
    main()
