"""Train a small CNN on scikit-learn's handwritten digits with plain DDP, on 2 local processes.

The training function is ordinary torch.distributed code: it reads RANK / WORLD_SIZE from the
environment that phalanx.run provides, exactly as under torchrun. Nothing is downloaded.

    .venv/bin/python examples/local_ddp_digits.py [--np 2] [--epochs 8] [--out model.pt]
"""

from __future__ import annotations

import argparse
import os
from typing import Any

import phalanx


def load_digits_split(seed: int = 0) -> tuple[Any, Any, Any, Any]:
    """1,797 8x8 images from scikit-learn, as float tensors (N, 1, 8, 8), split 80/20."""
    import torch
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    x, y = load_digits(return_X_y=True)
    x_tr, x_te, y_tr, y_te = train_test_split(x / 16.0, y, test_size=0.2, random_state=seed, stratify=y)

    def as_tensors(a: Any, b: Any) -> tuple[Any, Any]:
        return torch.tensor(a, dtype=torch.float32).view(-1, 1, 8, 8), torch.tensor(b, dtype=torch.long)

    return (*as_tensors(x_tr, y_tr), *as_tensors(x_te, y_te))


def make_model() -> Any:
    """A small CNN for 8x8 digits."""
    from torch import nn

    return nn.Sequential(
        nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(), nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(),
        nn.MaxPool2d(2), nn.Flatten(), nn.Linear(32 * 4 * 4, 64), nn.ReLU(), nn.Linear(64, 10),
    )


def save_atomically(obj: Any, path: str) -> None:
    """torch.save to a temporary file, then rename: a reader never sees a half-written model."""
    import torch

    tmp = f"{path}.tmp-{os.getpid()}"
    torch.save(obj, tmp)
    os.replace(tmp, path)


def train(epochs: int, out: str) -> dict[str, float]:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

    dist.init_process_group("gloo")
    rank, size = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    x_tr, y_tr, x_te, y_te = load_digits_split()
    data = TensorDataset(x_tr, y_tr)
    sampler = DistributedSampler(data, num_replicas=size, rank=rank, shuffle=True, seed=0)
    loader = DataLoader(data, batch_size=32, sampler=sampler)
    model = DDP(make_model())
    opt = torch.optim.Adam(model.parameters(), lr=1e-3 * size)
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        for xb, yb in loader:
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(xb), yb).backward()
            opt.step()
    with torch.no_grad():
        accuracy = (model(x_te).argmax(1) == y_te).float().mean().item()
    if rank == 0:
        save_atomically(model.module.state_dict(), out)
        print(f"epoch {epochs}: test accuracy {accuracy:.3f}", flush=True)
    dist.destroy_process_group()
    return {"rank": rank, "accuracy": accuracy}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--np", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--out", default=os.path.abspath("digits_ddp.pt"))
    args = parser.parse_args()
    results = phalanx.run(train, args=(args.epochs, args.out), np=args.np)
    print(f"test accuracy (rank 0): {results[0]['accuracy']:.3f}; model saved to {args.out}")


if __name__ == "__main__":
    main()
