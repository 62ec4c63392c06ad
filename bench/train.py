"""Training steps/s: ``hvd.DistributedOptimizer`` vs ``DistributedDataParallel`` on gloo, side by side.

Run: ``.venv/bin/python bench/train.py [--steps 2] [--rounds 40]``. Models: an 824k-parameter CNN
(CIFAR-shaped input, batch 64 per rank) and a 5.8M-parameter MLP (batch 32 per rank, communication-bound).
Both trainers run in the same 2-rank job, alternating in short chunks of steps (so machine noise hits both
alike; the order reversed every other round); each figure is total steps / total time, with the interquartile
range of the per-round ratios. A 1-rank job then compares ``DistributedOptimizer`` with
the plain optimizer (overhead).
"""

from __future__ import annotations

import argparse
import statistics
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
    )


def mlp() -> Any:
    """5.8M parameters: 784 -> 2048 -> 2048 -> 10."""
    import torch.nn as nn

    return nn.Sequential(nn.Linear(784, 2048), nn.ReLU(), nn.Linear(2048, 2048), nn.ReLU(), nn.Linear(2048, 10))


MODELS = {"cnn": (cnn, (64, 3, 32, 32)), "mlp": (mlp, (32, 784))}


def _seconds(model: Any, opt: Any, shape: tuple[int, ...], steps: int, start_together: bool = True) -> float:
    """Seconds of ``steps`` training steps after two warm-up steps (and, with ``start_together``, a barrier
    of every rank before the timed steps)."""
    import torch
    import torch.distributed as dist

    x, y = torch.randn(*shape), torch.randint(0, 10, (shape[0],))
    loss_fn = torch.nn.CrossEntropyLoss()
    for _ in range(2):  # warm-up
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        opt.step()
    if start_together and dist.is_initialized():
        dist.barrier()
    start = time.perf_counter()
    for _ in range(steps):
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        opt.step()
    return time.perf_counter() - start


def _chunks(trainers: dict[str, Any], shape: tuple[int, ...], steps: int, rounds: int) -> dict[str, list[float]]:
    """Seconds of each chunk of ``steps`` steps per trainer, alternating trainers for ``rounds`` rounds (the order
    reversed every other round, so that no trainer always runs right after the same other one)."""
    spent: dict[str, list[float]] = {k: [] for k in trainers}
    for r in range(rounds):
        for key in list(trainers) if r % 2 == 0 else list(trainers)[::-1]:
            trainer = trainers[key]  # (model, optimizer), or a callable (shape, steps) -> seconds
            if callable(trainer):
                spent[key].append(trainer(shape, steps))
            else:
                model, opt = trainer
                spent[key].append(_seconds(model, opt, shape, steps))
    return spent


def _interleaved(trainers: dict[str, Any], shape: tuple[int, ...], steps: int, rounds: int) -> dict[str, float]:
    """Steps/s of each trainer over :func:`_chunks`; ``"<a>/<b> q1"`` and ``"... q3"`` keys give the quartiles of
    the per-round ratios of steps/s between the first trainer and each other one (the spread behind the totals)."""
    spent = _chunks(trainers, shape, steps, rounds)
    out = {k: steps * rounds / sum(v) for k, v in spent.items()}
    first, *others = list(trainers)
    for key in others:
        ratios = [a / b for a, b in zip(spent[first], spent[key])]
        q1, _, q3 = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else (ratios[0],) * 3
        out[f"{key}/{first} q1"], out[f"{key}/{first} q3"] = q1, q3
    return out


def _trainers(name: str) -> dict[str, Any]:
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP

    import phalanx.torch as hvd

    make, _ = MODELS[name]
    ddp_model = DDP(make())
    hvd_model = make()
    hvd_opt = hvd.DistributedOptimizer(torch.optim.SGD(hvd_model.parameters(), lr=0.01),
                                       named_parameters=hvd_model.named_parameters())
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
    parser.add_argument("--rounds", type=int, default=40, help="chunks per trainer")
    parser.add_argument("--fusion-threshold", default="", help="HOROVOD_FUSION_THRESHOLD (bytes) for the job")
    args = parser.parse_args()
    env = {"HOROVOD_FUSION_THRESHOLD": args.fusion_threshold} if args.fusion_threshold else None
    two = phalanx.run(_bench_2, args=(args.steps, args.rounds), np=2, env=env)[0]
    print(f"training on 2 ranks, gloo, {args.rounds} x {args.steps} steps per trainer, interleaved (rank 0)")
    for name, r in two.items():
        ratio = r["hvd"] / r["ddp"]
        spread = f"per-round ratios' interquartile range {r['hvd/ddp q1']:.2f}-{r['hvd/ddp q3']:.2f}"
        print(f"  {name}: DDP {r['ddp']:.2f}/s  DistributedOptimizer {r['hvd']:.2f}/s  ratio {ratio:.2f}x ({spread})")
    one = phalanx.run(_bench_1, args=(args.steps, args.rounds), np=1)[0]
    print("1 rank: DistributedOptimizer vs the plain optimizer")
    for name, r in one.items():
        overhead = (r["plain"] / r["hvd"] - 1) * 100
        print(f"  {name}: plain {r['plain']:.2f}/s  DistributedOptimizer {r['hvd']:.2f}/s  overhead {overhead:+.1f}%")


if __name__ == "__main__":
    main()
