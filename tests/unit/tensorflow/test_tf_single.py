"""phalanx.tensorflow(.keras) in one process (one rank, no launcher): aliases, compile/fit patches, bad
arguments, and the error when TensorFlow is missing."""

from __future__ import annotations

import subprocess
import sys
import warnings
from collections.abc import Iterator

import pytest

from phalanx.env import names as N

pytest.importorskip("tensorflow")

import keras
import numpy as np

import phalanx.tensorflow.keras as hvd
from phalanx.errors import InvalidArgumentError


@pytest.fixture
def single(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    for name in (N.MASTER_ADDR, N.MASTER_PORT, N.RANK, N.WORLD_SIZE, N.LOCAL_RANK, N.HOROVOD_RANK):
        monkeypatch.delenv(name, raising=False)
    hvd.init()
    yield
    hvd.shutdown()


def _model() -> keras.Model:
    return keras.Sequential([keras.Input((3,)), keras.layers.Dense(2), keras.layers.Dense(1)])


def test_horovod_names_are_the_phalanx_modules() -> None:
    import horovod.keras
    import horovod.keras.callbacks
    import horovod.tensorflow
    import horovod.tensorflow.keras
    from sparkdl.horovod.tensorflow.keras import LogCallback

    import phalanx.tensorflow
    from phalanx.spark.keras_log import LogCallback as PhalanxLogCallback

    assert horovod.tensorflow.keras is hvd and horovod.keras is hvd and horovod.tensorflow is phalanx.tensorflow
    assert horovod.keras.callbacks is hvd.callbacks
    assert LogCallback is PhalanxLogCallback


def test_old_compile_argument_is_dropped_with_a_warning_and_jit_is_forced_off(single: None) -> None:
    model = _model()
    with pytest.warns(UserWarning, match="experimental_run_tf_function"):
        model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.1)), loss="mse",
                      experimental_run_tf_function=False)  # fmt: skip
    assert model.jit_compile is False
    with pytest.warns(UserWarning, match="XLA"):
        model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.1)), loss="mse", jit_compile=True)
    assert model.jit_compile is False
    history = model.fit(np.ones((8, 3), "float32"), np.ones((8, 1), "float32"), batch_size=4, epochs=2, verbose=0)
    assert len(history.history["loss"]) == 2
    plain = _model()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        plain.compile(optimizer="sgd", loss="mse", jit_compile=False)  # untouched without a distributed optimizer


def test_distributed_optimizer_keeps_class_and_config() -> None:
    opt = hvd.DistributedOptimizer(keras.optimizers.Adam(0.25, beta_1=0.8))
    assert isinstance(opt, keras.optimizers.Adam)
    assert opt.get_config()["beta_1"] == pytest.approx(0.8)
    assert float(opt.learning_rate) == pytest.approx(0.25)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [({"backward_passes_per_step": 0}, "backward_passes_per_step"), ({"op": 99}, "unknown reduce op"),
     ({"gradient_predivide_factor": 0.0}, "gradient_predivide_factor")],
)
def test_bad_arguments_are_named(kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        hvd.DistributedOptimizer(keras.optimizers.SGD(0.1), **kwargs)  # type: ignore[arg-type]


def test_not_a_keras_optimizer_is_refused() -> None:
    with pytest.raises(InvalidArgumentError, match=r"keras\.optimizers\.Optimizer"):
        hvd.DistributedOptimizer(object())


def test_schedule_callbacks_set_the_learning_rate(single: None) -> None:
    model = _model()
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(1.0)), loss="mse")
    seen: list[float] = []
    lr = model.optimizer
    record = keras.callbacks.LambdaCallback(on_epoch_end=lambda e, logs: seen.append(float(lr.learning_rate)))
    schedule = hvd.callbacks.LearningRateScheduleCallback(initial_lr=0.5, multiplier=lambda epoch: 0.1 ** epoch)
    model.fit(np.ones((8, 3), "float32"), np.ones((8, 1), "float32"), batch_size=4, epochs=3, verbose=0,
              callbacks=[schedule, hvd.callbacks.MetricAverageCallback(), record])  # fmt: skip
    assert seen == pytest.approx([0.5, 0.05, 0.005])
    warm = hvd.callbacks.LearningRateWarmupCallback(initial_lr=0.3, warmup_epochs=2)
    model.fit(np.ones((8, 3), "float32"), np.ones((8, 1), "float32"), batch_size=4, epochs=2, verbose=0,
              callbacks=[warm])  # fmt: skip
    assert float(model.optimizer.learning_rate) == pytest.approx(0.3)  # size 1: warmup is flat


def test_without_tensorflow_the_import_error_says_what_to_install() -> None:
    code = "import sys; sys.modules['tensorflow'] = None; import phalanx.tensorflow"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0
    assert "pip install 'phalanx[tensorflow]'" in proc.stderr
