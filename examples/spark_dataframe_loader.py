"""HorovodRunner fed from a Spark DataFrame: Petastorm's converter flow on scikit-learn's digits.

The DataFrame (a Spark ML vector of 64 pixels and a label per row) is written once as Parquet by
``make_spark_converter``; inside the training function every rank opens
``converter.make_torch_dataloader(cur_shard=hvd.rank(), shard_count=hvd.size())`` and reads only its share,
as in Petastorm's documentation (``from petastorm.spark import make_spark_converter`` works unchanged where
Petastorm is not installed). Nothing is downloaded.

    .venv/bin/python examples/spark_dataframe_loader.py [--np 2] [--epochs 5] [--cache /tmp/converter]
"""

from __future__ import annotations

import argparse
import os
import tempfile
from typing import Any

from phalanx.spark import HorovodRunner, make_spark_converter


def digits_frames(spark: Any) -> tuple[Any, Any]:
    """The digits as two DataFrames ``(train, test)`` of ``features`` (a dense Vector in [0, 1]) and
    ``label``, split 80/20 at random (seeded)."""
    from _digits import load_digits_arrays
    from pyspark.ml.linalg import Vectors

    x, y = load_digits_arrays()
    rows = [(Vectors.dense((x[i] / 16.0).tolist()), int(y[i])) for i in range(len(y))]
    frame = spark.createDataFrame(rows, ["features", "label"]).repartition(3)
    train, test = frame.randomSplit([0.8, 0.2], seed=0)
    return train, test


def train_hvd(converter: Any, test: tuple[Any, Any], epochs: int, batch_size: int = 32,
              lr: float = 1e-3) -> dict[str, Any]:
    """Every rank: the converter's loader, a fixed number of steps per epoch (Petastorm's pattern)."""
    import torch
    import torch.nn.functional as F
    from _digits import make_model

    import phalanx.torch as hvd  # or: import horovod.torch as hvd

    hvd.init()
    torch.manual_seed(0)
    model = make_model()
    opt: torch.optim.Optimizer = torch.optim.Adam(model.parameters(), lr=lr * hvd.size())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters())
    steps = max(1, len(converter) // (batch_size * hvd.size()))
    with converter.make_torch_dataloader(batch_size=batch_size, cur_shard=hvd.rank(), shard_count=hvd.size(),
                                         shuffling_queue_capacity=batch_size) as loader:
        batches = iter(loader)  # num_epochs=None: without end, so every rank takes `steps` per epoch
        for _ in range(epochs * steps):
            batch = next(batches)
            opt.zero_grad()
            loss = F.cross_entropy(model(batch["features"].view(-1, 1, 8, 8)), batch["label"])
            loss.backward()
            opt.step()
    x_te, y_te = test
    with torch.no_grad():
        accuracy = (model(x_te).argmax(1) == y_te).float().mean().item()
    return {"accuracy": accuracy, "size": hvd.size(), "rows": len(converter), "steps_per_epoch": steps}


def _test_tensors(test: Any) -> tuple[Any, Any]:
    import numpy as np
    import torch

    rows = test.collect()
    x = torch.tensor(np.array([r["features"].toArray() for r in rows]), dtype=torch.float32).view(-1, 1, 8, 8)
    return x, torch.tensor([r["label"] for r in rows])


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--np", type=int, default=2, help="ranks (Spark tasks)")
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--cache", default=None, help="the converter's cache directory (default: a temporary one)")
    args = parser.parse_args(argv)
    from pyspark.sql import SparkSession

    spark = SparkSession.builder.getOrCreate()
    cache = args.cache or tempfile.mkdtemp(prefix="phalanx-converter-")
    spark.conf.set("petastorm.spark.converter.parentCacheDirUrl", "file://" + os.path.abspath(cache))
    train, test = digits_frames(spark)
    converter = make_spark_converter(train)  # vectors -> float32 arrays, written once as Parquet
    try:
        result: dict[str, Any] = HorovodRunner(np=args.np).run(train_hvd, converter=converter,
                                                                test=_test_tensors(test), epochs=args.epochs)
    finally:
        converter.delete()
    print(f"test accuracy: {result['accuracy']:.3f} ({result['size']} ranks, {result['rows']} rows from the "
          f"DataFrame, {result['steps_per_epoch']} steps per epoch)")
    return result


if __name__ == "__main__":
    final = main()
    if final["accuracy"] < 0.9:
        raise SystemExit(f"test accuracy {final['accuracy']:.3f} is below 0.9")
