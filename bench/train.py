"""Training steps/s: ``hvd.DistributedOptimizer`` vs ``DistributedDataParallel`` on gloo, side by side.

Run: ``.venv/bin/python bench/train.py [--steps 20] [--rounds 3]``. Models: an 824k-parameter CNN
(CIFAR-shaped input, batch 64 per rank) and a 5.8M-parameter MLP (batch 32 per rank, communication-bound).
Both trainers run in the same 2-rank job, alternating in short chunks of steps (so machine noise hits both
alike); each figure is total steps / total time. A 1-rank job then compares ``DistributedOptimizer`` with
the plain optimizer (overhead).
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import phalanx


def cnn() -> Any:
    """824k parameters: two 3x3 convolutions, two poolings, a 196-unit hidden layer."""
    import torch.nn as nn

    return nn.Sequential(
        nn.Conv2d(3, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(64 * 8 * 8, 196), nn.ReLU(), nn.Linear(196, 10),
    )  # fmt: skip


def mlp() -> Any:
    """5.8M parameters: 784 -> 2048 -> 2048 -> 10."""
    import torch.nn as nn

    return nn.Sequential(nn.Linear(784, 2048), nn.ReLU(), nn.Linear(2048, 2048), nn.ReLU(), nn.Linear(2048, 10))


MODELS = {"cnn": (cnn, (64, 3, 32, 32)), "mlp": (mlp, (32, 784))}


def _seconds(model: Any, opt: Any, shape: tuple[int, ...], steps: int) -> float:
    import torch
    import torch.distributed as dist

    x, y = torch.randn(*shape), torch.randint(0, 10, (shape[0],))
    loss_fn = torch.nn.CrossEntropyLoss()
    for _ in range(2):  # warm-up
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        opt.step()
    if dist.is_initialized():
        dist.barrier()
    start = time.perf_counter()
    for _ in range(steps):
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        opt.step()
    return time.perf_counter() - start


def _interleaved(trainers: dict[str, Any], shape: tuple[int, ...], steps: int, rounds: int) -> dict[str, float]:
    """Steps/s of each trainer, alternating chunks of ``steps`` steps for ``rounds`` rounds."""
    spent = dict.fromkeys(trainers, 0.0)
    for _ in range(rounds):
        for key, (model, opt) in trainers.items():
            spent[key] += _seconds(model, opt, shape, steps)
    return {k: steps * rounds / v for k, v in spent.items()}


def _trainers(name: str) -> dict[str, Any]:
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP

    import phalanx.torch as hvd

    make, _ = MODELS[name]
    ddp_model = DDP(make())
    hvd_model = make()
    hvd_opt = hvd.DistributedOptimizer(torch.optim.SGD(hvd_model.parameters(), lr=0.01),
                                       named_parameters=hvd_model.named_parameters())  # fmt: skip
    return {"ddp": (ddp_model, torch.optim.SGD(ddp_model.parameters(), lr=0.01)), "hvd": (hvd_model, hvd_opt)}


def _bench_2(steps: int, rounds: int) -> dict[str, dict[str, float]]:
    import phalanx.torch as hvd

    hvd.init()
    out: dict[str, dict[str, float]] = {}
    for name, (_, shape) in MODELS.items():
        out[name] = _interleaved(_trainers(name), shape, steps, rounds)
    hvd.shutdown()
    return out


def _bench_1(steps: int, rounds: int) -> dict[str, dict[str, float]]:
    import torch

    import phalanx.torch as hvd

    hvd.init()
    out: dict[str, dict[str, float]] = {}
    for name, (make, shape) in MODELS.items():
        plain_model, hvd_model = make(), make()
        plain = torch.optim.SGD(plain_model.parameters(), lr=0.01)
        wrapped = hvd.DistributedOptimizer(torch.optim.SGD(hvd_model.parameters(), lr=0.01))
        trainers = {"plain": (plain_model, plain), "hvd": (hvd_model, wrapped)}
        out[name] = _interleaved(trainers, shape, steps, rounds)
    hvd.shutdown()
    return out


def main() -> None:
    """Run both jobs and print steps/s and ratios."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=2, help="steps per chunk")
    parser.add_argument("--rounds", type=int, default=20, help="chunks per trainer")
    parser.add_argument("--fusion-threshold", default="", help="HOROVOD_FUSION_THRESHOLD (bytes) for the job")
    args = parser.parse_args()
    env = {"HOROVOD_FUSION_THRESHOLD": args.fusion_threshold} if args.fusion_threshold else None
    two = phalanx.run(_bench_2, args=(args.steps, args.rounds), np=2, env=env)[0]
    print(f"training on 2 ranks, gloo, {args.rounds} x {args.steps} steps per trainer, interleaved (rank 0)")
    for name, r in two.items():
        ratio = r["hvd"] / r["ddp"]
        print(f"  {name}: DDP {r['ddp']:.2f}/s  DistributedOptimizer {r['hvd']:.2f}/s  ratio {ratio:.2f}x")
    one = phalanx.run(_bench_1, args=(args.steps, args.rounds), np=1)[0]
    print("1 rank: DistributedOptimizer vs the plain optimizer")
    for name, r in one.items():
        overhead = (r["plain"] / r["hvd"] - 1) * 100
        print(f"  {name}: plain {r['plain']:.2f}/s  DistributedOptimizer {r['hvd']:.2f}/s  overhead {overhead:+.1f}%")


if __name__ == "__main__":
    main()
