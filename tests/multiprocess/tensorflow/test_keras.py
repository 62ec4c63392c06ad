"""phalanx.tensorflow(.keras) on 2 real ranks: TF ops and dtypes, DistributedOptimizer variants (sparse
gradients, compression, float64/float16/bfloat16, mixed precision, gradient accumulation), load_model,
callbacks, and the mismatched-steps error. Each job packs many checks: importing TF costs seconds per rank."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

import phalanx

pytest.importorskip("tensorflow")
pytestmark = [pytest.mark.multiprocess]

ENV = {"TF_CPP_MIN_LOG_LEVEL": "2"}


def _data(n: int = 64, dim: int = 6, seed: int = 0) -> tuple[Any, Any]:
    import numpy as np

    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, dim)).astype("float32")
    return x, (x.sum(axis=1, keepdims=True) > 0).astype("float32")


def _fit(hvd: Any, model: Any, opt: Any, steps: int = 3, seed: int = 0, **fit: Any) -> Any:
    import tensorflow as tf

    x, y = _data(seed=seed + hvd.rank())  # different data per rank: only the average keeps weights equal
    model.compile(optimizer=opt, loss="mse")
    data = tf.data.Dataset.from_tensor_slices((x, y)).repeat().batch(8)
    cbs = [hvd.callbacks.BroadcastGlobalVariablesCallback(0)]
    return model.fit(data, steps_per_epoch=steps, epochs=fit.pop("epochs", 1), verbose=0, callbacks=cbs, **fit)


def _agree(hvd: Any, model: Any) -> bool:
    from _keras_helpers import weights_agree

    return weights_agree(hvd, model)


def _dense_model(dtype: str | None = None, seed: int = 0) -> Any:
    import keras

    keras.utils.set_random_seed(seed)
    return keras.Sequential([keras.Input((6,)), keras.layers.Dense(8, activation="relu", dtype=dtype),
                             keras.layers.Dense(1, dtype=dtype)])


def _ops_checks(hvd: Any, me: int) -> dict[str, Any]:
    import numpy as np
    import tensorflow as tf

    out: dict[str, Any] = {}
    for dt in (tf.float16, tf.bfloat16, tf.float32, tf.float64, tf.int32):
        t = tf.cast(tf.fill([3], me + 1), dt)
        out[f"allreduce {dt.name}"] = np.asarray(tf.cast(hvd.allreduce(t, op=hvd.Sum, name=f"s.{dt.name}"),
                                                         tf.float64)).tolist()
    out["average"] = hvd.allreduce(tf.constant([1.0 + me, 3.0])).numpy().tolist()
    out["fp16 compression"] = hvd.allreduce(tf.constant([1.0 + me]), compression=hvd.Compression.fp16).dtype.name
    out["allgather"] = hvd.allgather(tf.fill([me + 1, 2], float(me))).numpy().tolist()
    out["broadcast"] = hvd.broadcast(tf.constant([float(me)]), root_rank=1).numpy().tolist()
    graph = tf.function(lambda t: hvd.allreduce(t, op=hvd.Sum), jit_compile=False)
    out["in tf.function"] = graph(tf.constant([float(me), 1.0])).numpy().tolist()
    return out


def _training_checks(hvd: Any, me: int, tmp: str) -> dict[str, Any]:
    import keras

    out: dict[str, Any] = {}
    for dtype in ("float64", "float16", "bfloat16"):
        model = _dense_model(dtype, seed=me)
        _fit(hvd, model, hvd.DistributedOptimizer(keras.optimizers.SGD(0.01)))
        out[f"agree {dtype}"] = _agree(hvd, model)
    model = _dense_model(seed=me)
    _fit(hvd, model, hvd.DistributedOptimizer(keras.optimizers.Adam(0.01), compression=hvd.Compression.fp16))
    out["agree fp16 compression"] = _agree(hvd, model)
    model = _dense_model(seed=me)
    _fit(hvd, model, hvd.DistributedOptimizer(keras.optimizers.SGD(0.01, momentum=0.9), num_groups=3))
    out["agree num_groups"] = _agree(hvd, model)
    model = _dense_model(seed=me)
    opt = hvd.DistributedOptimizer(keras.optimizers.SGD(0.01), backward_passes_per_step=2,
                                   average_aggregated_gradients=True)
    _fit(hvd, model, opt, steps=4)
    out["agree accumulation"] = _agree(hvd, model)
    out["applied steps"] = int(opt.iterations.numpy())
    out["jit_compile"] = model.jit_compile
    return out


def _embedding_and_mixed_checks(hvd: Any, me: int) -> dict[str, Any]:
    import keras
    import numpy as np
    import tensorflow as tf

    from phalanx.tensorflow.keras.optimizer import base_class

    out: dict[str, Any] = {}
    keras.utils.set_random_seed(me)
    emb = keras.Sequential([keras.Input((4,), dtype="int32"), keras.layers.Embedding(50, 4),
                            keras.layers.Flatten(), keras.layers.Dense(1)])
    emb.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.Adam(0.01)), loss="mse")
    ids = np.random.default_rng(me).integers(0, 50, size=(32, 4)).astype("int32")
    emb.fit(ids, np.ones((32, 1), "float32"), batch_size=8, epochs=1, verbose=0,
            callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0)])
    out["agree embedding"] = _agree(hvd, emb)
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        model = _dense_model(seed=me)
        _fit(hvd, model, hvd.DistributedOptimizer(keras.optimizers.SGD(0.01)))
        out["mixed optimizer"] = base_class(model.optimizer).__name__
        out["agree mixed"] = _agree(hvd, model)
        out.update(_overflow_on_one_rank(hvd, me))
    finally:
        keras.mixed_precision.set_global_policy("float32")
    out["tf"] = tf.__version__
    return out


def _overflow_on_one_rank(hvd: Any, me: int) -> dict[str, Any]:
    """Only rank 1's float16 gradients overflow: the averaged gradients overflow on both ranks, so both skip
    the step and halve the loss scale (checking local gradients first would make the ranks disagree)."""
    import keras
    import numpy as np

    model = _dense_model(seed=3)  # the same initial weights on both ranks, no broadcast callback
    # Keras' order, built by hand: compile turns it into DistributedOptimizer(LossScaleOptimizer(SGD)).
    opt = keras.optimizers.LossScaleOptimizer(hvd.DistributedOptimizer(keras.optimizers.SGD(0.01)))
    model.compile(optimizer=opt, loss="mse")
    before = [w.copy() for w in model.get_weights()]
    x = np.full((8, 6), 1e6 if me == 1 else 0.5, dtype="float32")  # 1e6 is inf in float16
    model.fit(x, np.ones((8, 1), "float32"), batch_size=8, epochs=1, verbose=0)
    unchanged = all(np.array_equal(a, b) for a, b in zip(before, model.get_weights()))
    return {"overflow skipped": unchanged, "agree overflow": _agree(hvd, model),
            "loss scale": float(model.optimizer.dynamic_scale.numpy())}


def _checkpoint_checks(hvd: Any, me: int, tmp: str) -> dict[str, Any]:
    import keras

    from phalanx.tensorflow.keras.optimizer import base_class, is_distributed

    out: dict[str, Any] = {}
    model = _dense_model(seed=me)
    _fit(hvd, model, hvd.DistributedOptimizer(keras.optimizers.Adam(0.01)))
    path = os.path.join(tmp, "model.keras")
    if me == 0:
        model.save(path)
    hvd.allreduce([0.0], name="saved")  # a barrier: rank 0 has written the file
    loaded = hvd.load_model(path)
    out["loaded distributed"] = f"{is_distributed(loaded.optimizer)}:{base_class(loaded.optimizer).__name__}"
    out["loaded iterations"] = int(loaded.optimizer.iterations.numpy())
    _fit(hvd, loaded, loaded.optimizer, seed=5)
    out["agree after load"] = _agree(hvd, loaded)
    out["iterations after load"] = int(loaded.optimizer.iterations.numpy())
    other = _dense_model(seed=10 + me)
    other.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.1)), loss="mse")
    hvd.broadcast_global_variables(0)
    out["agree after broadcast_global_variables"] = _agree(hvd, other)
    return out


def _mismatch_checks(hvd: Any) -> dict[str, Any]:
    """Last in the job: it leaves the ranks' step counters apart (the job carries on after a mismatch)."""
    import keras

    out = []
    # Different steps per epoch; then different numbers of epochs.
    for steps, epochs in ((5 - hvd.rank(), 2), (3, 2 - hvd.rank())):
        try:
            _fit(hvd, _dense_model(), hvd.DistributedOptimizer(keras.optimizers.SGD(0.01)), steps=steps, epochs=epochs)
            out.append("no error")
        except Exception as e:
            out.append(f"{type(e).__name__}: {e}")
    return {"mismatch": out}


def _features_job(tmp: str) -> dict[str, Any]:
    import phalanx.tensorflow.keras as hvd

    hvd.init()
    me = hvd.rank()
    out = _ops_checks(hvd, me)
    out.update(_training_checks(hvd, me, tmp))
    out.update(_embedding_and_mixed_checks(hvd, me))
    out.update(_checkpoint_checks(hvd, me, tmp))
    out.update(_mismatch_checks(hvd))
    return out


@pytest.mark.timeout(240)
def test_ops_dtypes_optimizers_checkpoints_and_step_mismatches(tmp_path: Path) -> None:
    helpers = str(Path(__file__).parent)
    res = phalanx.run(_features_job, args=(str(tmp_path),), np=2, env={**ENV, "PYTHONPATH": helpers})
    r0, r1 = res
    for dt in ("float16", "bfloat16", "float32", "float64", "int32"):
        assert r0[f"allreduce {dt}"] == [3.0, 3.0, 3.0], dt
    assert r0["average"] == r1["average"] == [1.5, 3.0]
    assert r0["fp16 compression"] == "float32"
    assert r0["allgather"] == r1["allgather"] == [[0.0, 0.0], [1.0, 1.0], [1.0, 1.0]]
    assert r0["broadcast"] == r1["broadcast"] == [1.0]
    assert r0["in tf.function"] == [1.0, 2.0]
    agree = [k for k in r0 if k.startswith("agree")]
    assert len(agree) == 11
    for key in agree:
        assert r0[key] is True and r1[key] is True, key
    assert r0["applied steps"] == 2  # 4 batches, 2 backward passes per step
    assert r0["jit_compile"] is False
    assert r0["mixed optimizer"] == "LossScaleOptimizer"
    assert r0["overflow skipped"] is True and r1["overflow skipped"] is True
    assert r0["loss scale"] == r1["loss scale"] == 2.0**15 / 2
    assert r0["loaded distributed"] == "True:Adam"
    assert r0["loaded iterations"] == 3 and r0["iterations after load"] == 6
    # Ranks with different step counts fail on every rank, naming the cause.
    for steps_msg, epochs_msg in (r0["mismatch"], r1["mismatch"]):
        for msg in (steps_msg, epochs_msg):
            assert msg.startswith("CollectiveMismatchError: Ranks ran different numbers of training steps"), msg
            assert "steps_per_epoch" in msg
        assert "model.fit end of epoch 1 after 4 steps" in steps_msg, steps_msg
        assert "model.fit end of training after 1 epochs" in epochs_msg, epochs_msg
