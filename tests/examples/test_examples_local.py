"""Every example that runs without Spark, with small settings, as a user runs it; each asserts a test
accuracy floor on scikit-learn's digits (a 2-3 epoch run reaches 0.85-0.95; chance is 0.1)."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest
from example_helpers import load_example, phalanxrun, rank0_line

pytestmark = [pytest.mark.multiprocess]

FLOOR = 0.8
EPOCHS = "3"
#: Where the examples save by default: never the working directory (a user runs them from the repository).
TMP = Path(tempfile.gettempdir())


@pytest.mark.timeout(90)
def test_local_ddp_digits(tmp_path: Path) -> None:
    results = load_example("local_ddp_digits").main(["--np", "2", "--epochs", EPOCHS, "--out", str(tmp_path / "m.pt")])
    assert [r["rank"] for r in results] == [0, 1]
    assert results[0]["accuracy"] > FLOOR
    assert (tmp_path / "m.pt").is_file()


@pytest.mark.timeout(90)
def test_horovod_runner_on_the_driver(tmp_path: Path) -> None:
    """HorovodRunner(np=-2): 2 processes on the driver, no Spark job; rank 0 saves the model."""
    out = tmp_path / "model.pt"
    result = load_example("spark_digits").main(["--np", "-2", "--epochs", EPOCHS, "--out", str(out)])
    assert result["size"] == 2
    assert result["accuracy"] > FLOOR
    assert out.is_file() and [p.name for p in tmp_path.iterdir()] == ["model.pt"]  # no temporary left


@pytest.mark.timeout(90)
def test_unchanged_horovod_script_under_phalanxrun(tmp_path: Path) -> None:
    """`phalanxrun -np 2 python examples/horovod_train.py`, with the venv's bin first on PATH (activated)."""
    proc = phalanxrun("horovod_train.py", "--epochs", EPOCHS, cwd=tmp_path, timeout=80)
    found = rank0_line(proc.stdout, r"test accuracy: ([0-9.]+)")
    assert float(found.group(1)) > FLOOR
    assert (TMP / "digits_horovod.pt").is_file() and not list(tmp_path.iterdir())  # nothing left in the cwd


@pytest.mark.timeout(90)
def test_torch_distributor_ddp_function_local_mode() -> None:
    assert load_example("torch_distributor_ddp").main(["--epochs", EPOCHS]) > FLOOR


@pytest.mark.timeout(90)
def test_torch_distributor_ddp_script_with_arguments_local_mode() -> None:
    """TorchDistributor(...).run("ddp_train.py", "--lr=0.01", "--epochs=3"): rank 0's stdout."""
    assert load_example("torch_distributor_ddp").main(["--script", "--epochs", EPOCHS, "--lr", "0.01"]) > FLOOR


@pytest.mark.timeout(90)
def test_fsdp_under_torch_distributor() -> None:
    assert load_example("fsdp_digits").main(["--epochs", EPOCHS]) > FLOOR


@pytest.mark.timeout(120)
def test_lightning_under_torch_distributor() -> None:
    pytest.importorskip("lightning")
    assert load_example("lightning_digits").main(["--epochs", EPOCHS]) > FLOOR


LIGHTNING_SUMMARY = (r"test accuracy: ([0-9.]+); synced validation accuracy: ([0-9.]+); "
                     r"weights identical on 2 ranks: True; checkpoint: (\S+)")


@pytest.mark.timeout(240)
def test_lightning_horovod_script_under_phalanxrun(tmp_path: Path) -> None:
    """Horovod's Lightning guide: ``Trainer(strategy="horovod")`` in a script that never imports phalanx."""
    pytest.importorskip("lightning")
    cwd, tmp = tmp_path / "cwd", tmp_path / "tmp"
    cwd.mkdir()
    tmp.mkdir()
    # The default checkpoint directory: a fresh private one of rank 0's (never a fixed name in /tmp, which an
    # earlier run fills, so that Lightning names the file digits-v1.ckpt), and only one for the two ranks.
    proc = phalanxrun("lightning_horovod_digits.py", "--epochs", EPOCHS, cwd=cwd, timeout=220,
                      env={"TMPDIR": str(tmp)})
    found = rank0_line(proc.stdout, LIGHTNING_SUMMARY)
    assert float(found.group(1)) > FLOOR and float(found.group(2)) > FLOOR
    made = [p for p in tmp.iterdir() if p.name.startswith("lightning-horovod-ckpt-")]
    assert len(made) == 1 and made[0].stat().st_mode & 0o777 == 0o700, made
    assert found.group(3) == str(made[0] / "digits.ckpt") and Path(found.group(3)).is_file()
    assert not list(cwd.iterdir())  # the examples leave nothing in the working directory
    assert "[1]<stdout>:test accuracy" not in proc.stdout  # rank 0 reports


@pytest.mark.timeout(240)
def test_lightning_horovod_script_under_torch_distributor(tmp_path: Path) -> None:
    """One epoch (the full run is the phalanxrun test's), the script form with pytorch_lightning. The function
    form of the strategy runs under HorovodRunner and phalanx.spark.run (tests/examples/test_examples_spark.py),
    TorchDistributor's function form with Lightning DDP (test_lightning_under_torch_distributor)."""
    pytest.importorskip("pytorch_lightning")
    result = load_example("lightning_horovod_digits").main(
        ["--launcher", "distributor", "--epochs", "1", "--ckpt-dir", str(tmp_path), "--script",
         "--flavour", "pytorch_lightning"])
    assert result["size"] == 2 and result["weights_agree"]
    assert result["accuracy"] > 0.5  # one epoch; chance is 0.1
    assert (tmp_path / "digits.ckpt").is_file()


KERAS_ENV = {"TF_CPP_MIN_LOG_LEVEL": "2"}


@pytest.mark.timeout(120)
def test_classic_horovod_keras_script_under_phalanxrun(tmp_path: Path) -> None:
    """Horovod's Keras example, unchanged (``experimental_run_tf_function=False`` included), 2 ranks."""
    pytest.importorskip("tensorflow")
    proc = phalanxrun("keras_horovod_train.py", "--epochs", EPOCHS, cwd=tmp_path, timeout=110, env=KERAS_ENV)
    found = rank0_line(proc.stdout, r"test accuracy: ([0-9.]+); weights identical on 2 ranks: True")
    assert float(found.group(1)) > FLOOR
    assert "experimental_run_tf_function" not in proc.stdout + proc.stderr  # dropped silently on every rank
    assert (TMP / "digits_keras.keras").is_file() and not list(tmp_path.iterdir())


@pytest.mark.timeout(120)
def test_tf_gradient_tape_custom_loop_under_phalanxrun(tmp_path: Path) -> None:
    """A TF2 custom loop with DistributedGradientTape, as Horovod's guide shows it: 2 ranks, identical weights."""
    pytest.importorskip("tensorflow")
    proc = phalanxrun("tf_gradient_tape_digits.py", "--epochs", EPOCHS, cwd=tmp_path, timeout=110, env=KERAS_ENV)
    found = rank0_line(proc.stdout, r"test accuracy: ([0-9.]+) \(2 ranks\); identical weights: True")
    assert float(found.group(1)) > FLOOR


@pytest.mark.timeout(120)
def test_classic_horovod_keras_function_under_phalanx_run() -> None:
    pytest.importorskip("tensorflow")
    import phalanx

    results = phalanx.run(load_example("keras_horovod_train").train, kwargs={"epochs": int(EPOCHS)}, np=2,
                          env=KERAS_ENV)
    assert [r["rank"] for r in results] == [0, 1]
    assert all(r["weights_agree"] for r in results)
    assert results[0]["accuracy"] == results[1]["accuracy"] > FLOOR


@pytest.mark.timeout(120)
def test_keras_horovod_runner_on_the_driver() -> None:
    """HorovodRunner(np=-2) with a Keras function (LogCallback writes to stdout off Spark)."""
    pytest.importorskip("tensorflow")
    result = load_example("keras_spark_digits").main(["--np", "-2", "--epochs", EPOCHS])
    assert result["size"] == 2 and result["weights_agree"]
    assert result["accuracy"] > FLOOR


@pytest.mark.timeout(180)
def test_hf_trainer_with_deepspeed_under_phalanxrun(tmp_path: Path) -> None:
    """`phalanxrun -np 2 python examples/hf_trainer_tiny.py`: transformers.Trainer with ZeRO-2, nothing downloaded."""
    proc = phalanxrun("hf_trainer_tiny.py", "--steps", "20", cwd=tmp_path, timeout=170, env={"HF_HUB_OFFLINE": "1"})
    found = rank0_line(proc.stdout, r"ranks: 2; loss first step: ([0-9.]+); last step: ([0-9.]+);")
    assert float(found.group(2)) < 0.6 * float(found.group(1))


@pytest.mark.timeout(120)
def test_deepspeed_distributor_local_mode() -> None:
    """DeepspeedTorchDistributor(numGpus=2, localMode=True): ZeRO-2 with the dict config as pyspark's flags."""
    assert load_example("deepspeed_digits").main(["--epochs", EPOCHS]) > FLOOR
