"""Lightning steps/s: ``Trainer(strategy="horovod")`` vs ``Trainer(strategy="ddp")``, the same LightningModule.

Run: ``.venv/bin/python bench/lightning_horovod.py [--rounds 8] [--steps 20]``. It starts
``phalanxrun -np 2 python bench/lightning_horovod.py --worker``: in that one 2-rank job both strategies fit
bench/train.py's CNN (824k parameters, batch 64 per rank, SGD with momentum) in alternating fits of
``--steps`` steps, the order reversed every other round, so machine noise hits both alike. A fit's steps/s is
timed from its first to its last batch end (Trainer set-up, the strategies' broadcasts and wrapping excluded);
each figure is total steps / total time, with the interquartile range of the per-round ratios. DDP fits first,
so the job's process group is what a user's DDP job gets under phalanxrun (gloo becomes ``phalanx_shm``);
``hvd.init()`` then joins it.
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

BATCH = 64
STRATEGIES = ("horovod", "ddp")


def _fit(pl: Any, strategy: str, steps: int) -> float:
    """Steps/s of one fit of ``steps`` steps with ``strategy`` (between the first and last batch end)."""
    import torch
    import torch.nn.functional as F
    from torch.utils.data import DataLoader, TensorDataset
    from train import cnn

    class Net(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = cnn()

        def training_step(self, batch: Any, batch_idx: int) -> Any:
            return F.cross_entropy(self.net(batch[0]), batch[1])

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=0.01, momentum=0.9)

    ends: list[float] = []

    class Clock(pl.Callback):
        def on_train_batch_end(self, *args: Any) -> None:
            ends.append(time.perf_counter())

    world, local = int(os.environ["WORLD_SIZE"]), int(os.environ["LOCAL_WORLD_SIZE"])
    n = steps * BATCH * world
    data = TensorDataset(torch.randn(n, 3, 32, 32), torch.randint(0, 10, (n,)))
    placement = {"devices": local, "num_nodes": world // local} if strategy == "ddp" else {}
    trainer = pl.Trainer(
        strategy=strategy, accelerator="cpu", max_steps=steps, callbacks=[Clock()], logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, **placement,
    )
    trainer.fit(Net(), DataLoader(data, batch_size=BATCH))
    return (len(ends) - 1) / (ends[-1] - ends[0])


def worker(rounds: int, steps: int) -> None:
    """One rank: alternate the strategies; rank 0 prints one JSON line of per-round steps/s."""
    import lightning.pytorch as pl
    import torch

    torch.set_num_threads(1)  # 2 ranks on 2 cores (as bench/train.py)
    _fit(pl, "ddp", 4)  # warm-up; creates the process group as DDP does
    _fit(pl, "horovod", 4)
    per_round: dict[str, list[float]] = {s: [] for s in STRATEGIES}
    for r in range(rounds):
        for strategy in STRATEGIES if r % 2 == 0 else reversed(STRATEGIES):
            per_round[strategy].append(_fit(pl, strategy, steps))
    if int(os.environ["RANK"]) == 0:
        print("BENCH " + json.dumps(per_round), flush=True)


def _report(per_round: dict[str, list[float]], steps: int) -> None:
    total = {s: len(v) * steps / sum(steps / x for x in v) for s, v in per_round.items()}
    ratios = sorted(h / d for h, d in zip(per_round["horovod"], per_round["ddp"]))
    q = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else [ratios[0]] * 3
    print(f"Lightning CNN, 2 ranks, batch {BATCH}/rank, {len(ratios)} rounds of {steps} steps per strategy")
    print(f"  strategy='horovod': {total['horovod']:7.2f} steps/s")
    print(f"  strategy='ddp':     {total['ddp']:7.2f} steps/s")
    print(f"  horovod / ddp: {total['horovod'] / total['ddp']:.2f}x (per-round IQR {q[0]:.2f}-{q[2]:.2f}; "
          "target >= 1.0x)")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(args.rounds, args.steps)
        return
    phalanxrun = Path(sys.executable).parent / "phalanxrun"
    cmd = [str(phalanxrun), "-np", "2", sys.executable, str(Path(__file__).resolve()), "--worker",
           f"--rounds={args.rounds}", f"--steps={args.steps}"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    line = next((ln for ln in proc.stdout.splitlines() if "BENCH " in ln), None)
    if proc.returncode != 0 or line is None:
        tail = proc.stdout[-3000:] + proc.stderr[-3000:]
        sys.exit(f"bench/lightning_horovod.py: the job failed ({proc.returncode}):\n{tail}")
    _report(json.loads(line.split("BENCH ", 1)[1]), args.steps)


if __name__ == "__main__":
    main()
