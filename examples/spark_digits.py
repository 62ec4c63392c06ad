"""HorovodRunner with PyTorch: train a small CNN on scikit-learn's handwritten digits.

The flow of Databricks' HorovodRunner documentation, step by step: ``hvd.init()``; pin the GPU to
``hvd.local_rank()`` when CUDA is available; shard the data with ``DistributedSampler``; scale the learning
rate by ``hvd.size()``; wrap the optimizer in ``hvd.DistributedOptimizer``; broadcast the initial
parameters and optimizer state from rank 0; rank 0 saves the model (atomically). ``make demo`` runs it.

``--np 2`` runs 2 ranks as tasks of a Spark barrier stage (with no active SparkSession phalanx starts an
embedded ``local[*]`` one); ``--np -2`` runs 2 processes on the driver without Spark (the debugging mode).
Nothing is downloaded.

    .venv/bin/python examples/spark_digits.py [--np 2] [--epochs 10] [--out /tmp/digits_cnn.pt]
"""

from __future__ import annotations

import argparse
import os
import tempfile
from typing import Any

from phalanx.spark import HorovodRunner


def train_hvd(epochs: int = 10, out: str = os.path.join(tempfile.gettempdir(), "digits_cnn.pt"), batch_size: int = 32,
              lr: float = 1e-3) -> dict[str, Any]:
    """The training function every rank runs (Horovod API); rank 0's return value reaches the driver."""
    import torch
    import torch.nn.functional as F
    from _digits import accuracy, load_digits_split, make_model, save_atomically
    from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

    import phalanx.torch as hvd  # or, unchanged: import horovod.torch as hvd
    from phalanx.spark import log_to_driver  # or: from sparkdl.horovod import log_to_driver

    hvd.init()
    device = torch.device("cpu")
    if torch.cuda.is_available():
        torch.cuda.set_device(hvd.local_rank())  # one GPU per rank: the rank's own
        device = torch.device("cuda", hvd.local_rank())
    torch.manual_seed(0)
    x_tr, y_tr, x_te, y_te = load_digits_split()
    data = TensorDataset(x_tr, y_tr)
    sampler: DistributedSampler[Any] = DistributedSampler(data, num_replicas=hvd.size(), rank=hvd.rank(), seed=0)
    loader = DataLoader(data, batch_size=batch_size, sampler=sampler)
    model = make_model().to(device)
    opt: torch.optim.Optimizer = torch.optim.Adam(model.parameters(), lr=lr * hvd.size())  # batch is size x larger
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters())
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        for xb, yb in loader:
            opt.zero_grad()
            loss = F.cross_entropy(model(xb.to(device)), yb.to(device))
            loss.backward()
            opt.step()
        if hvd.rank() == 0:
            log_to_driver(f"epoch {epoch + 1}/{epochs}: last batch loss {loss.item():.4f}")
    test_accuracy = accuracy(model.cpu(), x_te, y_te)
    if hvd.rank() == 0:
        save_atomically(model.state_dict(), out)
    return {"accuracy": test_accuracy, "model": out, "size": hvd.size()}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--np", type=int, default=2, help="ranks: N on Spark, -N on the driver (default 2)")
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--out", default=os.path.join(tempfile.gettempdir(), "digits_cnn.pt"),
                        help="where rank 0 saves the model (default: the temporary directory)")
    args = parser.parse_args(argv)
    out = os.path.abspath(args.out)
    result: dict[str, Any] = HorovodRunner(np=args.np).run(train_hvd, epochs=args.epochs, out=out)
    where = "on Spark" if args.np > 0 else "on the driver"
    print(f"test accuracy: {result['accuracy']:.3f} ({result['size']} ranks {where})")
    print(f"model saved to {result['model']}")
    return result


if __name__ == "__main__":
    final = main()
    if final["accuracy"] < 0.9:
        raise SystemExit(f"test accuracy {final['accuracy']:.3f} is below 0.9")
