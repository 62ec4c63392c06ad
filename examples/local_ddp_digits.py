"""Train a small CNN on scikit-learn's handwritten digits with plain DDP, on 2 local processes.

The training function is ordinary torch.distributed code: it reads RANK / WORLD_SIZE from the
environment that phalanx.run provides, exactly as under torchrun. Nothing is downloaded.

    .venv/bin/python examples/local_ddp_digits.py [--np 2] [--epochs 8] [--out model.pt]
"""

from __future__ import annotations

import argparse
import os
import tempfile
from typing import Any

import phalanx


def train(epochs: int, out: str) -> dict[str, float]:
    import torch
    import torch.distributed as dist
    from _digits import load_digits_split, make_model, save_atomically
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

    dist.init_process_group("gloo")
    rank, size = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    x_tr, y_tr, x_te, y_te = load_digits_split()
    data = TensorDataset(x_tr, y_tr)
    sampler: DistributedSampler[Any] = DistributedSampler(data, num_replicas=size, rank=rank, shuffle=True, seed=0)
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


def main(argv: list[str] | None = None) -> list[dict[str, float]]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--np", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--out", default=os.path.join(tempfile.gettempdir(), "digits_ddp.pt"))
    args = parser.parse_args(argv)
    out = os.path.abspath(args.out)
    results: list[dict[str, float]] = phalanx.run(train, args=(args.epochs, out), np=args.np)
    print(f"test accuracy (rank 0): {results[0]['accuracy']:.3f}; model saved to {out}")
    return results


if __name__ == "__main__":
    main()
