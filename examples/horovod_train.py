"""A Horovod user's PyTorch training script, unchanged: ``import horovod.torch as hvd``.

phalanx provides the ``horovod`` package name (where the real Horovod is not installed), so this runs as
it ran under horovodrun:

    .venv/bin/phalanxrun -np 2 python examples/horovod_train.py --epochs 10

Trains a small CNN on scikit-learn's handwritten digits (nothing is downloaded); rank 0 prints the test
accuracy and saves the model.
"""

from __future__ import annotations

import argparse
import os
import tempfile
from typing import Any

import horovod.torch as hvd
import torch
import torch.nn.functional as F
from _digits import accuracy, load_digits_split, make_model, save_atomically
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset


def main() -> None:
    parser = argparse.ArgumentParser(description="Horovod digits example")
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--out", default=os.path.join(tempfile.gettempdir(), "digits_horovod.pt"),
                        help="where rank 0 saves the model (default: the temporary directory)")
    args = parser.parse_args()

    hvd.init()
    if torch.cuda.is_available():
        torch.cuda.set_device(hvd.local_rank())
    torch.manual_seed(0)
    x_tr, y_tr, x_te, y_te = load_digits_split()
    data = TensorDataset(x_tr, y_tr)
    sampler: DistributedSampler[Any] = DistributedSampler(data, num_replicas=hvd.size(), rank=hvd.rank())
    loader = DataLoader(data, batch_size=args.batch_size, sampler=sampler)
    model = make_model()
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr * hvd.size())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())

    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        for xb, yb in loader:
            optimizer.zero_grad()
            loss = F.cross_entropy(model(xb), yb)
            loss.backward()
            optimizer.step()
        # The mean loss over ranks: every rank takes part in the allreduce.
        mean_loss = hvd.allreduce(loss.detach(), name="loss").item()
        if hvd.rank() == 0:
            print(f"epoch {epoch + 1}/{args.epochs}: loss {mean_loss:.4f}", flush=True)

    test_accuracy = hvd.allreduce(torch.tensor(accuracy(model, x_te, y_te)), name="accuracy").item()
    if hvd.rank() == 0:
        save_atomically(model.state_dict(), os.path.abspath(args.out))
        print(f"test accuracy: {test_accuracy:.3f}", flush=True)


if __name__ == "__main__":
    main()
