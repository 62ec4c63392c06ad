"""FSDP under TorchDistributor, on CPU (gloo): torch-native sharded training is not limited to DDP.

Each rank holds a shard of every parameter, gradient and optimizer state (``fully_shard``, FSDP2); the
full parameters are gathered layer by layer for the forward and backward passes. The function reads its
rank from the environment that ``TorchDistributor`` sets, as under torchrun:

    .venv/bin/python examples/fsdp_digits.py [--num-processes 2] [--epochs 8] [--spark]

Trains a small CNN on scikit-learn's handwritten digits; nothing is downloaded.
"""

from __future__ import annotations

import argparse
import os
from typing import Any

from phalanx.spark import TorchDistributor


def train_fsdp(epochs: int = 8, lr: float = 0.01, batch_size: int = 32) -> float:
    """Train with FSDP on this rank; return the test accuracy (computed on rank 0's gathered model)."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from _digits import accuracy, load_digits_split, make_model
    from torch.distributed.fsdp import fully_shard
    from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    torch.manual_seed(0)  # the same initial weights on every rank before they are sharded
    x_tr, y_tr, x_te, y_te = load_digits_split()
    data = TensorDataset(x_tr, y_tr)
    sampler: DistributedSampler[Any] = DistributedSampler(data, num_replicas=world_size, rank=rank, seed=0)
    loader = DataLoader(data, batch_size=batch_size, sampler=sampler)
    model = make_model()
    for layer in model:
        if any(True for _ in layer.parameters()):
            fully_shard(layer)  # one all-gather / reduce-scatter unit per layer with parameters
    fully_shard(model)
    opt = torch.optim.Adam(model.parameters(), lr=lr)  # each rank steps its own shard
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        for xb, yb in loader:
            opt.zero_grad()
            F.cross_entropy(model(xb), yb).backward()
            opt.step()
    test_accuracy = accuracy(model, x_te, y_te)  # forward gathers the full parameters on every rank
    dist.destroy_process_group()
    return test_accuracy


def main(argv: list[str] | None = None) -> float:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-processes", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--lr", type=float, default=0.01)
    parser.add_argument("--spark", action="store_true", help="one Spark barrier task per rank (local_mode=False)")
    args = parser.parse_args(argv)
    distributor = TorchDistributor(num_processes=args.num_processes, local_mode=not args.spark, use_gpu=False)
    test_accuracy = float(distributor.run(train_fsdp, args.epochs, args.lr))
    print(f"test accuracy: {test_accuracy:.3f} (FSDP, {args.num_processes} ranks)")
    return test_accuracy


if __name__ == "__main__":
    main()
