"""phalanx.tensorflow.keras on Keras 2 (``tf_keras``, ``TF_USE_LEGACY_KERAS=1``), on 2 real ranks in one job:
the Keras TensorFlow chose, Horovod's import paths, gradient averaging by ``model.fit`` with a new and a legacy
optimizer (with accumulation), the callbacks, ``PartialDistributedOptimizer``, ``SyncBatchNormalization``,
elastic ``KerasState``, mixed precision, ``load_model`` and the ``KerasEstimator``'s Keras-dependent parts."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import pytest

import phalanx

pytest.importorskip("tensorflow")
pytest.importorskip("tf_keras")
pytestmark = [pytest.mark.multiprocess]

ENV = {"TF_CPP_MIN_LOG_LEVEL": "2", "TF_USE_LEGACY_KERAS": "1"}


def _flavour_checks() -> dict[str, Any]:
    import horovod.keras
    import horovod.tensorflow.keras
    import tensorflow as tf

    import phalanx.tensorflow.keras as hvd
    from phalanx.tensorflow import keras_flavour

    return {"flavour": keras_flavour.keras().__name__, "keras 3": keras_flavour.is_keras3(),
            "tf.keras model": tf.keras.Model.__module__.split(".")[0],
            "aliases": horovod.tensorflow.keras is hvd and horovod.keras is hvd}


def _averaging_checks(hvd: Any, me: int) -> dict[str, Any]:
    """One SGD step with lr 1 on loss mean(x @ w): the gradient is x's column means, (me + 1) on rank me,
    so averaged over 2 ranks every weight becomes -1.5 (a rank applying its own gradient gets -1 or -2)."""
    import numpy as np
    import tensorflow as tf

    out: dict[str, Any] = {}
    for kind, opt in (("new", tf.keras.optimizers.SGD(1.0)), ("legacy", tf.keras.optimizers.legacy.SGD(1.0))):
        model = tf.keras.Sequential([tf.keras.layers.Dense(1, use_bias=False, kernel_initializer="zeros",
                                                           input_shape=(3,))])
        model.compile(optimizer=hvd.DistributedOptimizer(opt), loss=lambda y, p: tf.reduce_mean(p))
        x = np.full((4, 3), me + 1.0, dtype="float32")
        model.fit(x, np.zeros((4, 1), "float32"), batch_size=4, epochs=1, verbose=0)
        out[f"averaged {kind}"] = model.get_weights()[0].ravel().tolist()
    return out


def _fit_checks(hvd: Any, me: int) -> dict[str, Any]:
    import numpy as np
    import tensorflow as tf
    from _keras_helpers import weights_agree
    from horovod.tensorflow import SyncBatchNormalization

    out: dict[str, Any] = {}
    rng = np.random.default_rng(me)  # different data and initial weights per rank
    x = rng.normal(size=(32, 4)).astype("float32")
    y = (x.sum(axis=1, keepdims=True) > 0).astype("float32")
    tf.keras.utils.set_random_seed(me)
    model = tf.keras.Sequential([tf.keras.layers.Dense(8, activation="relu", input_shape=(4,)),
                                 SyncBatchNormalization(), tf.keras.layers.Dense(1)])
    opt = hvd.DistributedOptimizer(tf.keras.optimizers.SGD(0.05, momentum=0.9))
    model.compile(optimizer=opt, loss="mse", metrics=["mae"])
    warmup = hvd.callbacks.LearningRateWarmupCallback(0.1, warmup_epochs=2, steps_per_epoch=4)
    history = model.fit(x, y, batch_size=8, epochs=3, verbose=0, callbacks=[
        hvd.callbacks.BroadcastGlobalVariablesCallback(0), hvd.callbacks.MetricAverageCallback(), warmup])
    out["agree fit"] = weights_agree(hvd, model)
    out["history"] = {k: [round(v, 6) for v in values] for k, values in history.history.items()}
    out["lr after warmup"] = float(model.optimizer.learning_rate.numpy())
    out["optimizer class"] = type(model.optimizer).__mro__[0].__module__.split(".")[0]

    tf.keras.utils.set_random_seed(me)
    model = tf.keras.Sequential([tf.keras.layers.Dense(4, input_shape=(4,)), tf.keras.layers.Dense(1)])
    opt = hvd.DistributedOptimizer(tf.keras.optimizers.legacy.Adam(0.01), backward_passes_per_step=2,
                                   average_aggregated_gradients=True)
    model.compile(optimizer=opt, loss="mse")
    model.fit(x, y, batch_size=8, epochs=1, verbose=0, callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0)])
    out["agree accumulation"] = weights_agree(hvd, model)
    out["applied steps"] = int(opt.iterations.numpy())

    tf.keras.utils.set_random_seed(me)
    model = tf.keras.Sequential([tf.keras.layers.Dense(4, input_shape=(4,)), tf.keras.layers.Dense(1)])
    local = model.layers[0]
    opt = hvd.PartialDistributedOptimizer(tf.keras.optimizers.SGD(0.05), local_layers=[local])
    model.compile(optimizer=opt, loss="mse")
    model.fit(x, y, batch_size=8, epochs=1, verbose=0, callbacks=[
        hvd.callbacks.BroadcastGlobalVariablesCallback(0, local_variables=local.trainable_weights)])
    out["partial shared agree"] = weights_agree(hvd, model.layers[1])  # layers have get_weights too
    out["partial local agree"] = weights_agree(hvd, local)
    return out


def _sync_batch_norm_checks(hvd: Any, me: int) -> dict[str, Any]:
    """Rank 0 holds 2 rows, rank 1 holds 3: the layer normalizes with the 5 rows' statistics, as Keras'
    own layer does on the whole batch."""
    import numpy as np
    import tensorflow as tf
    from horovod.tensorflow.sync_batch_norm import SyncBatchNormalization

    batch = np.arange(10, dtype="float32").reshape(5, 2) ** 1.5
    mine = batch[:2] if me == 0 else batch[2:]
    sync = SyncBatchNormalization(momentum=0.5)
    plain = tf.keras.layers.BatchNormalization(momentum=0.5, fused=False)
    got = sync(tf.constant(mine), training=True).numpy()
    want = plain(tf.constant(batch), training=True).numpy()
    want = want[:2] if me == 0 else want[2:]
    fused = "no error"
    try:
        SyncBatchNormalization(fused=True)
    except ValueError as e:
        fused = str(e)
    return {"sync bn output": bool(np.allclose(got, want, atol=1e-5)),
            "sync bn moving mean": bool(np.allclose(sync.moving_mean.numpy(), plain.moving_mean.numpy())),
            "sync bn moving variance": bool(np.allclose(sync.moving_variance.numpy(),
                                                        plain.moving_variance.numpy(), rtol=1e-5)),
            "sync bn fused": fused}


def _elastic_checks(hvd: Any, me: int) -> dict[str, Any]:
    import numpy as np
    import tensorflow as tf

    tf.keras.utils.set_random_seed(10 + me)
    model = tf.keras.Sequential([tf.keras.layers.Dense(2, input_shape=(3,))])
    model.compile(optimizer=hvd.DistributedOptimizer(tf.keras.optimizers.legacy.SGD(0.1, momentum=0.5)),
                  loss="mse")
    state = hvd.elastic.KerasState(model, batch=0, epoch=0)
    state.sync()  # every rank takes rank 0's weights and optimizer variables, and saves them
    synced = [w.copy() for w in model.get_weights()]
    model.set_weights([w + 100.0 for w in synced])
    state.restore()
    restored = all(np.array_equal(a, b) for a, b in zip(model.get_weights(), synced))
    x = np.ones((8, 3), "float32")
    model.fit(x, np.zeros((8, 2), "float32"), batch_size=4, epochs=2, verbose=0, callbacks=[
        hvd.elastic.CommitStateCallback(state), hvd.elastic.UpdateBatchStateCallback(state),
        hvd.elastic.UpdateEpochStateCallback(state)])
    return {"elastic synced": synced[0].ravel().tolist(), "elastic restored": restored,
            "elastic epoch": state.epoch, "elastic optimizer variables": len(state._opt_values)}


def _mixed_precision_checks(hvd: Any, me: int) -> dict[str, Any]:
    """Only rank 1's float16 gradients overflow: compile makes DistributedOptimizer(LossScaleOptimizer),
    so both ranks see the averaged (overflowed) gradients, skip the step and halve the loss scale."""
    import numpy as np
    import tensorflow as tf

    from phalanx.tensorflow.keras.optimizer import base_class

    tf.keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        tf.keras.utils.set_random_seed(3)  # the same initial weights on both ranks
        model = tf.keras.Sequential([tf.keras.layers.Dense(4, input_shape=(3,)),
                                     tf.keras.layers.Dense(1, dtype="float32")])
        model.compile(optimizer=hvd.DistributedOptimizer(tf.keras.optimizers.SGD(0.01)), loss="mse")
        before = [w.copy() for w in model.get_weights()]
        x = np.full((8, 3), 1e6 if me == 1 else 0.5, dtype="float32")  # 1e6 is inf in float16
        model.fit(x, np.ones((8, 1), "float32"), batch_size=8, epochs=1, verbose=0)
    finally:
        tf.keras.mixed_precision.set_global_policy("float32")
    return {"mixed optimizer": base_class(model.optimizer).__name__,
            "overflow skipped": all(np.array_equal(a, b) for a, b in zip(before, model.get_weights())),
            "loss scale": float(model.optimizer.loss_scale)}


def _load_checks(hvd: Any, me: int, tmp: str) -> dict[str, Any]:
    import numpy as np
    import tensorflow as tf

    from phalanx.tensorflow.keras.optimizer import base_class, is_distributed

    path = os.path.join(tmp, "legacy.h5")
    if me == 0:
        model = tf.keras.Sequential([tf.keras.layers.Dense(1, input_shape=(3,))])
        model.compile(optimizer=tf.keras.optimizers.legacy.Adam(0.01), loss="mse")
        model.fit(np.ones((4, 3), "float32"), np.ones((4, 1), "float32"), verbose=0)
        model.save(path)
    hvd.allreduce([0.0], name="saved")  # a barrier: rank 0 has written the file
    loaded = hvd.load_model(path, legacy_opts=True)
    opt = loaded.optimizer
    return {"loaded": f"{is_distributed(opt)}:{base_class(opt).__module__.split('.')[-2]}.{base_class(opt).__name__}"}


def _keras2_job(tmp: str, examples: str) -> dict[str, Any]:
    import phalanx.tensorflow.keras as hvd

    hvd.init()
    me = hvd.rank()
    out = _flavour_checks()
    out.update(_averaging_checks(hvd, me))
    out.update(_fit_checks(hvd, me))
    out.update(_sync_batch_norm_checks(hvd, me))
    out.update(_elastic_checks(hvd, me))
    out.update(_mixed_precision_checks(hvd, me))
    out.update(_load_checks(hvd, me, tmp))
    from _keras2_estimator import estimator_checks

    out.update(estimator_checks(hvd, me, tmp))
    sys.path.insert(0, examples)  # Horovod's Keras example (and its _digits), all tf.keras, one epoch
    import keras_horovod_train

    out["example"] = keras_horovod_train.train(epochs=1)
    return out


@pytest.mark.timeout(240)
def test_keras2_fit_callbacks_layers_and_elastic_state(tmp_path: Path) -> None:
    helpers = str(Path(__file__).parent)
    examples = str(Path(__file__).parents[3] / "examples")
    r0, r1 = phalanx.run(_keras2_job, args=(str(tmp_path), examples), np=2, env={**ENV, "PYTHONPATH": helpers})
    for r in (r0, r1):
        assert r["flavour"] == r["tf.keras model"] == "tf_keras" and r["keras 3"] is False
        assert r["aliases"] is True
        assert r["averaged new"] == r["averaged legacy"] == [-1.5, -1.5, -1.5]
        assert r["optimizer class"] == "tf_keras"
        for key in ("agree fit", "agree accumulation", "partial shared agree", "sync bn output",
                    "sync bn moving mean", "sync bn moving variance", "elastic restored"):
            assert r[key] is True, key
        assert r["partial local agree"] is False  # the local layer trains on each rank's own gradients
        assert r["lr after warmup"] == pytest.approx(0.1)
        assert r["applied steps"] == 2  # 4 batches, 2 backward passes per step
        assert "fused=True" in r["sync bn fused"]
        assert r["elastic epoch"] == 2 and r["elastic optimizer variables"] > 0
        assert r["loaded"] == "True:legacy.Adam"
        assert r["mixed optimizer"] == "LossScaleOptimizerV3" and r["overflow skipped"] is True
        assert r["loss scale"] == 2.0**15 / 2
    assert r0["history"] == r1["history"]  # MetricAverageCallback: the same averaged metrics on both ranks
    for r in (r0, r1):  # KerasEstimator (tests/multiprocess/tensorflow/_keras2_estimator.py)
        assert r["estimator env"] == {"TF_USE_LEGACY_KERAS": "1"} and r["log callback"] is True
        assert r["estimator epochs"] == r["resumed epochs"] == [0, 1] and r["resumed steps"] == [2]
    assert r0["estimator model"] == "tf_keras" and r0["estimator predicts"] is True
    assert r0["resumed like uninterrupted"] is True
    assert r0["example"]["weights_agree"] is True and r0["example"]["accuracy"] > 0.3  # 1 epoch; chance is 0.1
    assert r0["elastic synced"] == r1["elastic synced"]
