"""TorchEstimator's training step on one in-process rank (no Spark): Horovod's parameters and rules for
backward_passes_per_step, labels shaped like the model's output, and sample weights with reduction='none'."""

from __future__ import annotations

from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("pyarrow")

import phalanx.torch as hvd
from phalanx.errors import InvalidArgumentError
from phalanx.spark.estimator.schema import ColumnSpec
from phalanx.spark.estimator.torch_remote import compute_loss, run_epoch, shaped_labels

X = ColumnSpec("x", "array", 2, "float32")
Y = ColumnSpec("y", "scalar", 1, "float32")
W = ColumnSpec("w", "scalar", 1, "float32")


@pytest.fixture
def single(no_launcher: None) -> Iterator[None]:
    hvd.init()
    yield
    hvd.shutdown()


def _spec(batches: int, **params: Any) -> Any:
    rng = np.random.default_rng(0)
    data = [{"x": rng.random((4, 2), dtype=np.float32), "y": (rng.random(4) > 0.5).astype(np.float32),
             "w": np.array([1.0, 2.0, 0.0, 1.0], dtype=np.float32)} for _ in range(batches)]
    return SimpleNamespace(data=SimpleNamespace(features=[X], labels=[Y], weight=W),
                           params={"loss": F.binary_cross_entropy, **params},
                           batches=lambda rank, size, epoch, validation: iter(data))


@pytest.mark.parametrize(("passes", "batches", "steps"), [(1, 5, 5), (2, 5, 3), (3, 6, 2)])
def test_backward_passes_per_step_accumulates_then_steps(single: None, passes: int, batches: int,
                                                         steps: int) -> None:
    model = torch.nn.Sequential(torch.nn.Linear(2, 1), torch.nn.Sigmoid())
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                         named_parameters=model.named_parameters(), backward_passes_per_step=passes)
    calls: list[int] = []
    step = optimizer.step
    optimizer.step = lambda closure=None: calls.append(1) or step(closure)  # type: ignore[method-assign]
    metrics, taken = run_epoch(_spec(batches, backward_passes_per_step=passes), model, optimizer, 0,
                               torch.device("cpu"), validation=False)
    assert taken == batches and len(calls) == steps and np.isfinite(metrics["loss"])


def test_sample_weights_call_the_loss_with_reduction_none() -> None:
    out = torch.tensor([[0.2], [0.9], [0.6]])
    label = torch.tensor([0.0, 1.0, 1.0])
    weights = torch.tensor([1.0, 3.0, 0.0])
    [shaped] = shaped_labels(out, [label], given=False)  # [3] against [3, 1]: the output's shape
    assert shaped.shape == out.shape
    spec = SimpleNamespace(params={"loss": F.binary_cross_entropy})  # a stock functional loss
    expected = (F.binary_cross_entropy(out, shaped, reduction="none").flatten() * weights).mean()
    assert torch.allclose(compute_loss(spec, out, [shaped], weights), expected)
    module = torch.nn.BCELoss()  # a loss module: its reduction is 'none' for the call, then restored
    spec = SimpleNamespace(params={"loss": module})
    assert torch.allclose(compute_loss(spec, out, [shaped], weights), expected) and module.reduction == "mean"
    assert shaped_labels(out, [torch.zeros(3, 2)], given=False)[0].shape == (3, 2)  # counts differ: kept
    assert shaped_labels(out, [label], given=True)[0].shape == (3,)  # label_shapes given: kept


def test_backward_passes_per_step_is_a_parameter_and_checked() -> None:
    pytest.importorskip("pyspark")
    from phalanx.spark.estimator.torch import TorchEstimator

    model = torch.nn.Linear(2, 1)
    est = TorchEstimator(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), loss=F.mse_loss,
                         backward_passes_per_step=4)
    assert est.getBackwardPassesPerStep() == 4 and TorchEstimator().getBackwardPassesPerStep() == 1
    values = {"model": model, "optimizer": torch.optim.SGD(model.parameters(), lr=0.1), "loss": F.mse_loss}
    for bad in (0, 1.5, True):
        with pytest.raises(InvalidArgumentError, match="backward_passes_per_step"):
            est.check_framework({**values, "backward_passes_per_step": bad})


def test_keras_estimator_takes_the_prefetch_buffer_size() -> None:
    pytest.importorskip("pyspark")
    keras = pytest.importorskip("keras")
    from phalanx.spark.estimator.keras import KerasEstimator

    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    est = KerasEstimator(model=model, optimizer=keras.optimizers.SGD(), loss="mse",
                         tensorflow_dataset_prefetch_buffer_size=4)
    assert est.getTensorflowDatasetPrefetchBufferSize() == 4
    values = {"model": model, "optimizer": keras.optimizers.SGD(), "loss": "mse"}
    est.check_framework({**values, "tensorflow_dataset_prefetch_buffer_size": 0})
    with pytest.raises(InvalidArgumentError, match="tensorflow_dataset_prefetch_buffer_size"):
        est.check_framework({**values, "tensorflow_dataset_prefetch_buffer_size": -1})
