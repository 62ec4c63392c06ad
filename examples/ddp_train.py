"""A plain torch.distributed (DDP) training script: it reads the rank from the environment, like any
script written for ``torchrun``.

It runs unchanged under every launcher that sets torch's variables (``RANK``, ``WORLD_SIZE``,
``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``):

    .venv/bin/phalanxrun -np 2 python examples/ddp_train.py --lr=0.01
    .venv/bin/python examples/torch_distributor_ddp.py --script   # TorchDistributor(...).run("ddp_train.py", ...)
    torchrun --nproc-per-node 2 examples/ddp_train.py

``train`` is also the function that ``examples/torch_distributor_ddp.py`` hands to ``TorchDistributor``.
Rank 0 prints the test accuracy (``test accuracy: 0.9xx``) and saves the model. Nothing is downloaded.
"""

from __future__ import annotations

import argparse
import os
from typing import Any


def train(epochs: int = 8, lr: float = 0.01, batch_size: int = 32, out: str | None = None) -> float:
    """Train with DDP on this rank; return the test accuracy (the same on every rank).

    Args:
        epochs: passes over the training set.
        lr: learning rate of Adam (for the whole job; not scaled by the world size).
        batch_size: per-rank batch size.
        out: where rank 0 saves the model's ``state_dict`` (None: not saved).
    """
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from _digits import accuracy, load_digits_split, make_model, save_atomically
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

    rank = int(os.environ["RANK"])
    world_size = int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ["LOCAL_RANK"])
    use_cuda = torch.cuda.is_available()
    if use_cuda:
        torch.cuda.set_device(local_rank)
    # MASTER_ADDR / MASTER_PORT come from the environment too (init_method "env://", the default).
    dist.init_process_group("nccl" if use_cuda else "gloo", rank=rank, world_size=world_size)
    device = torch.device("cuda", local_rank) if use_cuda else torch.device("cpu")
    torch.manual_seed(0)
    x_tr, y_tr, x_te, y_te = load_digits_split()
    data = TensorDataset(x_tr, y_tr)
    sampler: DistributedSampler[Any] = DistributedSampler(data, num_replicas=world_size, rank=rank, seed=0)
    loader = DataLoader(data, batch_size=batch_size, sampler=sampler)
    model = DDP(make_model().to(device), device_ids=[local_rank] if use_cuda else None)
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        for xb, yb in loader:
            opt.zero_grad()
            F.cross_entropy(model(xb.to(device)), yb.to(device)).backward()
            opt.step()
    test_accuracy = accuracy(model.module.cpu(), x_te, y_te)
    if rank == 0 and out:
        save_atomically(model.module.state_dict(), out)
    dist.destroy_process_group()
    return test_accuracy


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="DDP digits example")
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--lr", type=float, default=0.01)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--out", default=None, help="where rank 0 saves the model (default: not saved)")
    args = parser.parse_args(argv)
    out = os.path.abspath(args.out) if args.out else None
    test_accuracy = train(args.epochs, args.lr, args.batch_size, out)
    if int(os.environ["RANK"]) == 0:
        print(f"test accuracy: {test_accuracy:.3f}", flush=True)


if __name__ == "__main__":
    main()
