"""The examples that run on Spark, on one ``local[2]`` session for the whole module (tests/spark's
fixture: one JVM), with small settings; each asserts a test accuracy floor on scikit-learn's digits."""

from __future__ import annotations

import importlib.util
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from example_helpers import REPO, load_example

from phalanx.env import names as env_names

pytestmark = [pytest.mark.spark]

FLOOR = 0.8
EPOCHS = "3"
#: The estimators' examples reach the floor in fewer epochs (each epoch is a pass over the store's data).
ESTIMATOR_EPOCHS = "2"


def _spark_fixtures() -> ModuleType:
    # tests/ is not a package: load tests/spark/conftest.py by path to reuse its session fixture.
    spec = importlib.util.spec_from_file_location("phalanx_spark_fixtures", REPO / "tests" / "spark" / "conftest.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_fixtures = _spark_fixtures()


@pytest.fixture(scope="module")
def local_spark() -> Iterator[Any]:
    """tests/spark's ``local[2]`` session, stopped when this module ends (the tiers after it need no Spark)."""
    yield _fixtures.shared_local_spark()
    _fixtures.stop_active_spark()


@pytest.fixture
def process_is_expected() -> Callable[[int], bool]:
    """PySpark's reusable python daemons (and the warm-start templates they start) are not leftovers."""
    owned: Callable[[int], bool] = _fixtures._spark_owned
    return owned


@pytest.mark.timeout(120)
def test_horovod_runner_on_spark(local_spark: Any, tmp_path: Path) -> None:
    """HorovodRunner(np=2): 2 barrier tasks; rank 0 saves the model atomically (no temporary left)."""
    out = tmp_path / "model.pt"
    result = load_example("spark_digits").main(["--np", "2", "--epochs", EPOCHS, "--out", str(out)])
    assert result["size"] == 2
    assert result["accuracy"] > FLOOR
    assert out.is_file() and [p.name for p in tmp_path.iterdir()] == ["model.pt"]  # no temporary left


@pytest.mark.timeout(90)
def test_torch_distributor_ddp_function_on_spark(local_spark: Any) -> None:
    assert load_example("torch_distributor_ddp").main(["--spark", "--epochs", EPOCHS]) > FLOOR


@pytest.mark.timeout(300)  # includes the session fixture when run alone
def test_lightning_horovod_runner_on_spark(local_spark: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """HorovodRunner(np=2) running Trainer(strategy="horovod") in 2 barrier tasks; rank 0's checkpoint."""
    pytest.importorskip("lightning")
    monkeypatch.setenv(env_names.HOROVOD_START_TIMEOUT, "120")  # task start-up on a busy 2-core host exceeded 30 s
    result = load_example("lightning_horovod_digits").main(
        ["--launcher", "horovodrunner", "--np", "2", "--epochs", EPOCHS, "--ckpt-dir", str(tmp_path)])
    assert result["size"] == 2 and result["weights_agree"]
    assert result["accuracy"] > FLOOR and result["val_acc"] > FLOOR
    assert result["checkpoint"] == str(tmp_path / "digits.ckpt") and (tmp_path / "digits.ckpt").is_file()


@pytest.mark.timeout(240)
def test_lightning_horovod_under_phalanx_spark_run(local_spark: Any, tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """horovod.spark.run's form (every rank's result, rank order); one epoch, pytorch_lightning."""
    pytest.importorskip("pytorch_lightning")
    monkeypatch.setenv(env_names.HOROVOD_START_TIMEOUT, "120")
    result = load_example("lightning_horovod_digits").main(
        ["--launcher", "spark-run", "--epochs", "1", "--flavour", "pytorch_lightning", "--ckpt-dir", str(tmp_path)])
    assert result["size"] == 2 and result["weights_agree"] and result["accuracy"] > 0.5


@pytest.mark.timeout(180)
def test_keras_horovod_runner_on_spark(local_spark: Any, capsys: pytest.CaptureFixture[str]) -> None:
    """HorovodRunner(np=2) with Keras: identical weights, accuracy floor, LogCallback lines on the driver."""
    pytest.importorskip("tensorflow")
    result = load_example("keras_spark_digits").main(["--np", "2", "--epochs", EPOCHS])
    assert result["size"] == 2 and result["weights_agree"]
    assert result["accuracy"] > FLOOR
    out = capsys.readouterr().out
    for epoch in range(1, int(EPOCHS) + 1):
        assert f"[0]<stdout>:epoch {epoch}: accuracy: " in out, out[-2000:]


@pytest.mark.timeout(480)
def test_torch_estimator_digits(local_spark: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """TorchEstimator -> fit -> transform on held-out rows: accuracy floor; one line per epoch on the driver."""
    pytest.importorskip("pyarrow")
    result = load_example("spark_estimator_digits").main(
        ["--np", "2", "--epochs", ESTIMATOR_EPOCHS, "--store", str(tmp_path)])
    assert result["accuracy"] > FLOOR
    history = result["history"]
    assert len(history) == int(ESTIMATOR_EPOCHS) and "validation" in history[-1]
    assert all(len(set(h["steps_per_rank"])) == 1 for h in history)  # 80/20 split: unequal shares
    assert f"[0]<stdout>:epoch {ESTIMATOR_EPOCHS}/{ESTIMATOR_EPOCHS}: loss=" in capsys.readouterr().out


@pytest.mark.timeout(480)
@pytest.mark.parametrize("framework", ["keras", "lightning"])
def test_keras_and_lightning_estimators_digits(local_spark: Any, framework: str) -> None:
    """KerasEstimator and Lightning's TorchEstimator on the digits: held-out accuracy floor."""
    pytest.importorskip("pyarrow")
    pytest.importorskip("tensorflow" if framework == "keras" else "lightning")
    result = load_example("spark_estimator_keras_lightning").main(
        ["--framework", framework, "--epochs", ESTIMATOR_EPOCHS])
    assert result["accuracy"] > FLOOR, result["history"]


@pytest.mark.timeout(180)
def test_horovod_runner_fed_by_the_dataframe_converter(local_spark: Any, tmp_path: Path) -> None:
    """HorovodRunner(np=2) reading the digits DataFrame through make_spark_converter; delete() cleans up."""
    pytest.importorskip("pyarrow")
    result = load_example("spark_dataframe_loader").main(["--np", "2", "--epochs", EPOCHS, "--cache", str(tmp_path)])
    assert result["size"] == 2 and result["accuracy"] > FLOOR
    assert result["steps_per_epoch"] == result["rows"] // 64
    assert list(tmp_path.iterdir()) == []  # the converter's Parquet data is gone
