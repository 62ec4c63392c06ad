"""The Lightning estimator's contract without Spark jobs: both Lightning flavours' modules, and Horovod's
terminate_on_nan and profiler parameters."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("pyspark")
pytest.importorskip("pyarrow")
L = pytest.importorskip("lightning.pytorch")
pl = pytest.importorskip("pytorch_lightning")

from phalanx.errors import InvalidArgumentError  # noqa: E402
from phalanx.spark.estimator.lightning import TorchEstimator  # noqa: E402

# white-box: _nan_guard: the remote trainer's internal check (no public name)
from phalanx.spark.estimator.lightning_remote import _nan_guard, flavour_of  # noqa: E402


class _Unified(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(2, 1)


class _Standalone(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(2, 1)


def test_both_lightning_flavours_are_accepted_and_trained_by_their_own_trainer() -> None:
    assert flavour_of(_Unified()) == "lightning.pytorch" and flavour_of(_Standalone()) == "pytorch_lightning"
    assert flavour_of(torch.nn.Linear(2, 1)) is None
    est = TorchEstimator()
    for module in (_Unified(), _Standalone()):
        est.check_framework({"model": module})
    with pytest.raises(InvalidArgumentError, match=r"pytorch_lightning\.LightningModule"):
        est.check_framework({"model": torch.nn.Linear(2, 1)})


def test_terminate_on_nan_and_profiler_are_horovods_parameters() -> None:
    est = TorchEstimator(model=_Standalone(), terminate_on_nan=True, profiler="simple")
    assert est.getTerminateOnNan() is True and est.getProfiler() == "simple"
    assert TorchEstimator().getTerminateOnNan() is False and TorchEstimator().getProfiler() is None
    for flavour in (L, pl):
        guard = _nan_guard(flavour)
        assert isinstance(guard, flavour.Callback)
        module = _Standalone()
        guard.on_train_batch_end(None, module, {"loss": torch.tensor(0.5)}, None, 0)
        with pytest.raises(ValueError, match="terminate_on_nan"):
            guard.on_train_batch_end(None, module, {"loss": torch.tensor(float("nan"))}, None, 3)
        with torch.no_grad():
            module.layer.weight[0, 0] = float("inf")
        with pytest.raises(ValueError, match=r"layer\.weight"):
            guard.on_train_batch_end(None, module, torch.tensor(0.5), None, 4)
