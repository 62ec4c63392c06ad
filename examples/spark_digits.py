"""Train a small CNN on scikit-learn's handwritten digits with HorovodRunner(np=2) on an embedded Spark.

The workflow of Databricks' HorovodRunner documentation: a training function written with the Horovod
API (``hvd.init``, ``hvd.DistributedOptimizer``, ``hvd.broadcast_parameters``), run as 2 ranks of a Spark
barrier stage. With no active SparkSession phalanx starts an embedded ``local[*]`` one. Rank 0 saves the
model (atomically) and its test accuracy comes back to the driver. Nothing is downloaded.

    .venv/bin/python examples/spark_digits.py [--np 2] [--epochs 10] [--out digits_cnn.pt]
"""

from __future__ import annotations

import argparse
import os
from typing import Any

from phalanx.spark import HorovodRunner


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
    """torch.save to a temporary file next to ``path``, then rename: no reader sees half a model."""
    import torch

    tmp = f"{path}.tmp-{os.getpid()}"
    torch.save(obj, tmp)
    os.replace(tmp, path)


def train_hvd(epochs: int = 10, out: str = "digits_cnn.pt", batch_size: int = 32) -> dict[str, Any]:
    """The training function every rank runs (Horovod API)."""
    import torch
    import torch.nn.functional as F

    import phalanx.torch as hvd
    from phalanx.spark import log_to_driver

    hvd.init()
    torch.manual_seed(0)
    x_tr, y_tr, x_te, y_te = load_digits_split()
    shard = torch.arange(hvd.rank(), len(x_tr), hvd.size())  # each rank trains on its own shard
    model = make_model()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3 * hvd.size())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters())
    generator = torch.Generator().manual_seed(hvd.rank())
    for epoch in range(epochs):
        order = shard[torch.randperm(len(shard), generator=generator)]
        for start in range(0, len(order), batch_size):
            idx = order[start : start + batch_size]
            opt.zero_grad()
            loss = F.cross_entropy(model(x_tr[idx]), y_tr[idx])
            loss.backward()
            opt.step()
        if hvd.rank() == 0:
            log_to_driver(f"epoch {epoch + 1}/{epochs}: last batch loss {loss.item():.4f}")
    with torch.no_grad():
        accuracy = (model(x_te).argmax(1) == y_te).float().mean().item()
    if hvd.rank() == 0:
        save_atomically(model.state_dict(), out)
    return {"accuracy": accuracy, "model": out, "size": hvd.size()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--np", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--out", default=os.path.abspath("digits_cnn.pt"))
    args = parser.parse_args()
    result = HorovodRunner(np=args.np).run(train_hvd, epochs=args.epochs, out=os.path.abspath(args.out))
    print(f"test accuracy: {result['accuracy']:.3f} ({result['size']} ranks on Spark)")
    print(f"model saved to {result['model']}")
    if result["accuracy"] < 0.9:
        raise SystemExit(f"test accuracy {result['accuracy']:.3f} is below 0.9")


if __name__ == "__main__":
    main()
