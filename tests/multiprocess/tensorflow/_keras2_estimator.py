"""KerasEstimator on Keras 2, run by every rank of test_keras2.py's job (``TF_USE_LEGACY_KERAS=1``): the
driver's checks and model bytes, ``keras_remote.train`` on both ranks with a legacy optimizer and
``LogCallback``, a resume from rank 0's checkpoint, and the ``KerasModel`` built from the result. The data is
in memory (the estimator's Spark side, Parquet and the reader, does not depend on the Keras)."""

from __future__ import annotations

import pickle
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import numpy as np

X_COLUMN = "x"
Y_COLUMN = "y"


def _spec(blob: bytes, store: Any, me: int, resume_epoch: int, callbacks: list[Any]) -> Any:
    from phalanx.spark.estimator.schema import ColumnSpec

    rng = np.random.default_rng(me)
    x = rng.normal(size=(8, 2)).astype("float32")
    batches = [{X_COLUMN: x[i:i + 4], Y_COLUMN: x[i:i + 4] @ np.array([1.0, 2.0], "float32")} for i in (0, 4)]

    def epoch_batches(rank: int, size: int, epoch: int, validation: bool) -> Iterator[dict[str, np.ndarray]]:
        return iter(batches)

    data = SimpleNamespace(features=[ColumnSpec(X_COLUMN, "array", 2, "float32")],
                           labels=[ColumnSpec(Y_COLUMN, "scalar", 1, "float32")], weight=None, val=[])
    params = {"epochs": 2, "random_seed": 1, "callbacks": callbacks, "verbose": 0}
    return SimpleNamespace(model_blob=blob, data=data, store=store, run_id="keras2", params=params,
                           resume_epoch=resume_epoch, batches=epoch_batches, steps=lambda size, validation: 2,
                           checkpoint_path=lambda epoch: f"{store.get_checkpoint_path('keras2')}/epoch-{epoch}",
                           log_epoch=lambda record: None)


def estimator_checks(hvd: Any, me: int, tmp: str) -> dict[str, Any]:
    import tensorflow as tf

    from phalanx.spark.estimator.keras_remote import train
    from phalanx.spark.estimator.store import LocalStore
    from phalanx.spark.keras import KerasEstimator
    from phalanx.spark.keras_log import LogCallback

    tf.keras.utils.set_random_seed(7)
    model = tf.keras.Sequential([tf.keras.layers.Dense(1, input_shape=(2,))])
    est = KerasEstimator(model=model, optimizer=tf.keras.optimizers.legacy.SGD(0.05, momentum=0.5), loss="mse",
                         feature_cols=[X_COLUMN], label_cols=[Y_COLUMN])
    values = est.values()
    est.check_framework(values)
    blob = est.model_blob(values)
    store = LocalStore(f"{tmp}/store")
    logged = LogCallback()
    full = train(_spec(blob, store, me, -1, [logged]))
    hvd.allreduce([0.0], name="estimator checkpoint written")  # a barrier: rank 0 has checkpointed epoch 0
    resumed = train(_spec(blob, store, me, 0, []))
    out: dict[str, Any] = {"estimator env": est.rank_env(), "log callback": isinstance(logged.model, tf.keras.Model),
                           "estimator epochs": [r["epoch"] for r in full["history"]],
                           "resumed epochs": [r["epoch"] for r in resumed["history"]],
                           "resumed steps": resumed["steps"]}
    if me == 0:
        trained = est.make_model(full, _spec(blob, store, me, -1, []))
        keras_model = trained.getModel()
        x = np.ones((1, 2), "float32")
        out["estimator model"] = type(keras_model).__module__.split(".")[0]
        out["estimator predicts"] = bool(np.allclose(keras_model(x).numpy(), trained.model_from_bytes(
            trained.model_bytes())(x).numpy()))
        # the momentum travels in the checkpoint: epoch 1 after a resume ends where the uninterrupted run did
        out["resumed like uninterrupted"] = all(np.allclose(a, b) for a, b in zip(
            pickle.loads(full["state"]), pickle.loads(resumed["state"])))
    return out
