"""Horovod's Spark estimator with PyTorch: fit a CNN to scikit-learn's digits held in a DataFrame.

The digits become a DataFrame with a ``features`` vector column (64 pixels) and a ``label`` column; 20% of
the rows are held out. ``TorchEstimator(...).fit(train_df)`` trains on ``--np`` ranks of a Spark job (each
reads its own share of the rows from the store), returns a ``TorchModel``, whose ``transform`` adds the
``label__output`` column (10 logits per row) on the executors; the accuracy on the held-out rows is
printed. With no active SparkSession phalanx starts an embedded ``local[*]`` one. Nothing is downloaded.

    .venv/bin/python examples/spark_estimator_digits.py [--np 2] [--epochs 5] [--store /tmp/digits-store]
"""

from __future__ import annotations

import argparse
import tempfile
from typing import Any

import numpy as np

from phalanx.spark.torch import LocalStore, TorchEstimator  # or: from horovod.spark.torch import ...


def digits_frames(spark: Any, seed: int = 0) -> tuple[Any, Any]:
    """The digits as ``(train_df, test_df)``: ``features`` (a DenseVector of 64 values in [0, 1]) and
    ``label`` (0..9), split 80/20 at random. The 1797 rows are one partition: a task per partition would
    only add tasks (and model loads in ``transform``) for data this small."""
    from _digits import load_digits_arrays
    from pyspark.ml.linalg import Vectors

    x, y = load_digits_arrays()
    rows = [(Vectors.dense(xi / 16.0), int(yi)) for xi, yi in zip(x, y)]
    df = spark.createDataFrame(rows, ["features", "label"]).coalesce(1)
    train, test = df.randomSplit([0.8, 0.2], seed=seed)
    return train, test


def accuracy(predictions: Any) -> float:
    """The fraction of rows whose largest logit is the label."""
    rows = predictions.select("label", "label__output").collect()
    return float(np.mean([int(np.argmax(r["label__output"])) == r["label"] for r in rows]))


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Fit, transform the held-out rows, print and return ``{"accuracy", "history", "model"}``."""
    import torch
    from _digits import make_model
    from pyspark.sql import SparkSession

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--np", type=int, default=2, help="number of ranks")
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--store", default=None, help="the store's directory (default: a temporary one)")
    args = parser.parse_args(argv)

    spark = SparkSession.builder.getOrCreate()
    train_df, test_df = digits_frames(spark)
    torch.manual_seed(0)
    model = make_model()
    estimator = TorchEstimator(
        num_proc=args.np, model=model, optimizer=torch.optim.Adam(model.parameters(), lr=2e-3),
        loss=torch.nn.functional.cross_entropy, feature_cols=["features"], label_cols=["label"],
        input_shapes=[[-1, 1, 8, 8]], batch_size=args.batch_size, epochs=args.epochs, validation=0.1,
        random_seed=0, store=LocalStore(args.store or tempfile.mkdtemp(prefix="digits-store-")))
    trained = estimator.fit(train_df)
    test_accuracy = accuracy(trained.transform(test_df))
    last = trained.getHistory()[-1]
    print(f"held-out accuracy {test_accuracy:.3f}; last epoch {last}")
    return {"accuracy": test_accuracy, "history": trained.getHistory(), "model": trained}


if __name__ == "__main__":
    main()
