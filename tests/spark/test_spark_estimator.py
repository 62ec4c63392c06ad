"""The Spark estimators on ``local[2]``: one JVM for the module, few jobs, each checking several things."""

from __future__ import annotations

import itertools
import json
import os
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("pyarrow")
torch = pytest.importorskip("torch")

from phalanx.errors import InvalidArgumentError, WorkerFailedError  # noqa: E402
from phalanx.spark.common.backend import SparkBackend  # noqa: E402
from phalanx.spark.torch import LocalStore, TorchEstimator, TorchModel  # noqa: E402

pytestmark = [pytest.mark.spark]

ROWS = 96
SIZE = 6


def _frame(spark: Any, rows: int = ROWS, sparse: bool = True, partitions: int = 3) -> Any:
    """Rows whose label is the index of the largest of SIZE features (sparse vectors: 2 non-zeros), in
    unevenly sized partitions; every 4th row is marked for validation."""
    from pyspark.ml.linalg import Vectors

    rng = np.random.default_rng(0)
    data = []
    for i in range(rows):
        idx = sorted(rng.choice(SIZE, 2, replace=False).tolist())
        vals = rng.random(2).tolist()
        vec = Vectors.sparse(SIZE, idx, vals) if sparse else Vectors.dense(np.bincount(idx, vals, SIZE))
        data.append((vec, int(idx[int(np.argmax(vals))]), float(1 + i % 2), i % 4 == 0))
    sc = spark.sparkContext
    cuts = [0, *(rows * (i + 3) // (partitions + 2) for i in range(partitions - 1)), rows]  # first ~3x the rest
    rdd = sc.union([sc.parallelize(data[a:b], 1) for a, b in itertools.pairwise(cuts)])
    return spark.createDataFrame(rdd, ["features", "label", "weight", "is_val"])


def _estimator(store: LocalStore, **overrides: Any) -> TorchEstimator:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(SIZE, 16), torch.nn.ReLU(), torch.nn.Linear(16, SIZE))
    params: dict[str, Any] = dict(
        num_proc=2, model=model, optimizer=torch.optim.Adam(model.parameters(), lr=0.02),
        loss=torch.nn.CrossEntropyLoss(reduction="none"), sample_weight_col="weight", feature_cols=["features"],
        label_cols=["label"], batch_size=8, epochs=2, validation="is_val", random_seed=3, store=store, verbose=1)
    params.update(overrides)
    return TorchEstimator(**params)


def fail_in_epoch_one(epoch: int, record: dict[str, Any]) -> None:
    """A callback that interrupts the run after epoch 1's checkpoint: on rank 0, which writes it before
    calling the callbacks (a rank that raised first could have the job stopped before rank 0's write)."""
    import phalanx.torch as hvd

    if epoch == 1 and hvd.rank() == 0:
        raise RuntimeError("interrupted on purpose")


@pytest.mark.timeout(600)  # three jobs, five Spark stages with torch in the python workers
def test_fit_sparse_validation_column_transform_pipeline_and_resume(local_spark: Any, tmp_path: Path) -> None:
    """Sparse vectors, a validation column, sample weights; equal steps on every rank with uneven partitions;
    transform equals the model's own forward; a Pipeline saved and loaded gives the same outputs; a run
    interrupted after epoch 1 resumes from its checkpoint."""
    from pyspark.ml import PipelineModel

    store = LocalStore(str(tmp_path / "store"))
    df = _frame(local_spark)
    run = "resume-me"
    with pytest.raises(WorkerFailedError, match="interrupted on purpose"):
        _estimator(store, run_id=run, epochs=3, callbacks=[fail_in_epoch_one],
                   train_steps_per_epoch=5).fit(df)
    ckpts = sorted(os.listdir(tmp_path / "store" / "runs" / run / "checkpoints"))
    assert ckpts == ["epoch-0000.pt", "epoch-0001.pt"]
    first = torch.load(tmp_path / "store" / "runs" / run / "checkpoints" / "epoch-0001.pt", weights_only=False)

    # Horovod's estimator examples give the ranks through a SparkBackend: its num_proc is honoured.
    backend = SparkBackend(num_proc=2, stdout=sys.stdout, stderr=sys.stderr, prefix_output_with_timestamp=True)
    trained = _estimator(store, run_id=run, epochs=3, train_steps_per_epoch=5, num_proc=None,
                         backend=backend).fit(df)
    history = trained.getHistory()
    assert [h["epoch"] for h in history] == [0, 1, 2]
    assert history[:2] == first["history"]  # epochs 0-1 restored, not retrained
    assert all(h["steps_per_rank"] == [5, 5] for h in history)
    assert all("loss" in h["validation"] for h in history)
    logged = (tmp_path / "store" / "runs" / run / "logs" / "history.jsonl").read_text().splitlines()
    assert [json.loads(line)["epoch"] for line in logged] == [0, 1, 2]

    # One transform job: the Pipeline saved and loaded must give the trained model's own forward.
    test = df.limit(20).drop("label")
    assert "label" not in trained.transform(test).columns and "label__output" in trained.transform(test).columns
    PipelineModel([trained]).save(str(tmp_path / "pipeline"))
    loaded = PipelineModel.load(str(tmp_path / "pipeline"))
    assert isinstance(loaded.stages[0], TorchModel) and loaded.stages[0].getHistory() == history
    out = loaded.transform(test).collect()
    assert len(out) == 20
    feats = torch.tensor(np.stack([r["features"].toArray() for r in out]), dtype=torch.float32)
    with torch.no_grad():
        expected = trained.getModel()(feats).numpy()
    np.testing.assert_allclose(np.stack([r["label__output"] for r in out]), expected, rtol=1e-5, atol=1e-5)


def _bad(local_spark: Any, tmp_path: Path) -> list[tuple[str, Any, dict[str, Any]]]:
    df = _frame(local_spark, rows=16, partitions=1)
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    return [
        ("feature column 'nope' is not in the DataFrame", df, {"feature_cols": ["nope"]}),
        ("label column 'tag' has type string", df.withColumn("tag", df["label"].cast("string")),
         {"label_cols": ["tag"]}),
        ("'features' has 6 value.* per row, which does not fit input_shapes entry \\[-1, 2, 2\\]", df,
         {"input_shapes": [[-1, 2, 2]]}),
        ("has no rows", df.limit(0), {}),
        ("cannot be written from the executors", df, {"store": LocalStore(str(blocker / "store"))}),
        ("validation=1.5 is outside", df, {"validation": 1.5}),
    ]


@pytest.mark.timeout(300)
def test_bad_input_fails_before_training(local_spark: Any, tmp_path: Path) -> None:
    for pattern, df, overrides in _bad(local_spark, tmp_path):
        store = overrides.pop("store", LocalStore(str(tmp_path / "store")))
        with pytest.raises(InvalidArgumentError, match=pattern):
            _estimator(store, run_id="bad", **overrides).fit(df)
        assert not (tmp_path / "store" / "runs" / "bad" / "checkpoints").exists()
