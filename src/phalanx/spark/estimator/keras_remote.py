"""The training loop every rank of a ``KerasEstimator`` run executes (runs in the phalanx worker), and the
model's ``.keras`` bytes both ways.

A model is trained by the Keras ``tf.keras`` is on the rank (``keras_flavour``: Keras 3, or ``tf_keras``
under ``TF_USE_LEGACY_KERAS=1``), which must be the Keras that built it: the estimator gives the ranks the
driver's choice (``rank_env``). Loading a ``.keras`` file needs no ``tf.keras``: its ``metadata.json`` names
the Keras version that wrote it, and that package loads it (a ``transform`` task's Python worker has no
phalanx environment).
"""

from __future__ import annotations

import importlib
import io
import json
import math
import os
import pickle
import tempfile
import zipfile
from collections.abc import Iterator, Mapping, Sequence
from types import ModuleType
from typing import TYPE_CHECKING, SupportsFloat

import cloudpickle
import numpy as np

from phalanx.errors import InvalidArgumentError
from phalanx.spark.driver_log import log_to_driver
from phalanx.spark.estimator.job import EpochRecord, TrainResult, TrainSpec, epoch_line
from phalanx.spark.estimator.reader import Batch, prefetched

if TYPE_CHECKING:
    import keras

#: A model's inputs or labels as ``fit`` takes them: one array, or one per column.
Arrays = np.ndarray | tuple[np.ndarray, ...]
#: One batch for ``fit``: (inputs, labels) or (inputs, labels, sample weights).
KerasBatch = tuple[Arrays, Arrays] | tuple[Arrays, Arrays, np.ndarray]


#: The variable by which TensorFlow chooses the Keras of ``tf.keras`` (read once, at its first use).
LEGACY_KERAS_VAR = "TF_USE_LEGACY_KERAS"


def keras_of(model: object) -> ModuleType:
    """The Keras package ``model``'s class comes from (``keras`` or ``tf_keras``)."""
    return importlib.import_module(type(model).__module__.split(".", 1)[0])


def rank_env(package: ModuleType) -> dict[str, str]:
    """The variable that makes a rank's ``tf.keras`` the Keras ``package`` is (TensorFlow 2.16+)."""
    return {LEGACY_KERAS_VAR: "0" if str(getattr(package, "__version__", "3")).startswith("3.") else "1"}


def saved_by(data: bytes) -> ModuleType:
    """The Keras package that reads the ``.keras`` file ``data``: ``keras`` for a Keras 3 file, else the
    Keras 2 of ``tf.keras`` when it is Keras 2, else ``tf_keras``.

    Raises:
        InvalidArgumentError: ``data`` is not a ``.keras`` file.
    """
    try:
        with zipfile.ZipFile(io.BytesIO(data)) as archive:
            version = str(json.loads(archive.read("metadata.json"))["keras_version"])
    except (zipfile.BadZipFile, KeyError, ValueError) as e:
        raise InvalidArgumentError(f"not a .keras model file ({type(e).__name__}: {e})") from e
    if version.startswith("3."):
        return importlib.import_module("keras")
    from phalanx.tensorflow import keras_flavour

    return keras_flavour.keras() if not keras_flavour.is_keras3() else importlib.import_module("tf_keras")


def load_model(data: bytes, custom_objects: Mapping[str, object] | None) -> keras.Model:
    """A Keras model from the bytes of its ``.keras`` file, loaded by the Keras that wrote it."""
    keras = saved_by(data)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "model.keras")
        with open(path, "wb") as f:
            f.write(data)
        return keras.models.load_model(path, custom_objects=custom_objects, compile=False)


def save_model(model: keras.Model) -> bytes:
    """The bytes of ``model``'s ``.keras`` file."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "model.keras")
        model.save(path)
        with open(path, "rb") as f:
            return f.read()


def shaped(arrays: Sequence[np.ndarray], shapes: Sequence[Sequence[int | None]]) -> list[np.ndarray]:
    """Each array reshaped to its input's shape (``(rows, *shape)``) when the sizes agree."""
    out = []
    for array, shape in zip(arrays, shapes):
        dims = [d for d in list(shape)[1:] if d is not None]
        fits = len(dims) == len(shape) - 1 and math.prod(dims) == math.prod(array.shape[1:])
        out.append(array.reshape(len(array), *dims) if fits else array)
    return out


def _xy(batch: Batch, spec: TrainSpec, model: keras.Model) -> KerasBatch:
    data = spec.data
    given = spec.params.get("input_shapes")
    shapes = given or [tuple(t.shape) for t in model.inputs]
    x = shaped([batch[c.name] for c in data.features], shapes)
    y = [batch[c.name] for c in data.labels]
    xs = x[0] if len(x) == 1 else tuple(x)
    ys = y[0] if len(y) == 1 else tuple(y)
    return (xs, ys, batch[data.weight.name]) if data.weight else (xs, ys)


def _batches(spec: TrainSpec, model: keras.Model, rank: int, size: int, epoch: int, validation: bool,
             counter: list[int]) -> Iterator[KerasBatch]:
    depth = int(spec.params.get("tensorflow_dataset_prefetch_buffer_size") or 0)
    batches = (_xy(batch, spec, model) for batch in spec.batches(rank, size, epoch, validation))
    for item in prefetched(batches, depth) if depth else batches:
        counter[0] += 1
        yield item


def _checkpoint(spec: TrainSpec, model: keras.Model, epoch: int, history: list[EpochRecord]) -> None:
    from phalanx.tensorflow import keras_flavour

    variables = keras_flavour.optimizer_variables(model.optimizer)
    state = {"weights": model.get_weights(), "optimizer": [np.asarray(v) for v in variables],
             "history": history, "epoch": epoch}
    spec.store.write(spec.checkpoint_path(epoch), pickle.dumps(state))
    spec.log_epoch(history[-1])


def _restore(spec: TrainSpec, model: keras.Model) -> list[EpochRecord]:
    if spec.resume_epoch < 0:
        return []
    state = pickle.loads(spec.store.read(spec.checkpoint_path(spec.resume_epoch)))
    from phalanx.tensorflow import keras_flavour

    model.set_weights(state["weights"])
    variables = keras_flavour.optimizer_variables(model.optimizer, build_on=model.trainable_variables)
    for variable, value in zip(variables, state["optimizer"]):
        variable.assign(value)
    return list(state["history"])


def _record(epoch: int, logs: Mapping[str, SupportsFloat], steps: int) -> EpochRecord:
    train = {k: float(v) for k, v in logs.items() if not k.startswith("val_")}
    val = {k[4:]: float(v) for k, v in logs.items() if k.startswith("val_")}
    record: EpochRecord = {"epoch": epoch, "train": train, "steps": steps}
    if val:
        record["validation"] = val
    return record


def _rank_keras(model_file: bytes) -> ModuleType:
    """The Keras of this rank's ``tf.keras``, which must be the one that wrote the model.

    Raises:
        InvalidArgumentError: they differ (TensorFlow chose before the rank's environment was set).
    """
    from phalanx.tensorflow import keras_flavour

    keras = keras_flavour.keras()
    wrote = saved_by(model_file)
    if keras is not wrote:
        raise InvalidArgumentError(
            f"the model is a {wrote.__name__} model but this rank's tf.keras is {keras_flavour.version_label()}: "
            f"set {LEGACY_KERAS_VAR}={rank_env(wrote)[LEGACY_KERAS_VAR]} in the executors' environment before "
            "TensorFlow is imported there")
    return keras


def train(spec: TrainSpec) -> TrainResult:
    """Train on this rank's shard with ``phalanx.tensorflow.keras``; rank 0 checkpoints every epoch.
    Returns the history, this rank's steps per epoch, and (rank 0) the trained weights, pickled."""
    import tensorflow as tf

    import phalanx.tensorflow.keras as hvd

    hvd.init()
    payload = cloudpickle.loads(spec.model_blob)
    keras = _rank_keras(payload["model"])
    if spec.params.get("random_seed") is not None:
        keras.utils.set_random_seed(int(spec.params["random_seed"]))
    model = load_model(payload["model"], payload.get("custom_objects"))
    optimizer = hvd.DistributedOptimizer(keras.optimizers.deserialize(payload["optimizer"]))
    model.compile(optimizer=optimizer, loss=payload["loss"], loss_weights=spec.params.get("loss_weights"),
                  metrics=payload.get("metrics") or None)
    history = _restore(spec, model)
    rank, size, epochs, steps = hvd.rank(), hvd.size(), int(spec.params["epochs"]), []
    for epoch in range(spec.resume_epoch + 1, epochs):
        counter = [0]
        callbacks = [hvd.callbacks.BroadcastGlobalVariablesCallback(0), hvd.callbacks.MetricAverageCallback(),
                     *(spec.params.get("callbacks") or [])]
        val = None
        if spec.data.val:
            val = _batches(spec, model, rank, size, epoch, True, [0])
        batches = _batches(spec, model, rank, size, epoch, False, counter)
        fit = model.fit(batches, steps_per_epoch=spec.steps(size, False),
                        initial_epoch=epoch, epochs=epoch + 1, validation_data=val,
                        validation_steps=spec.steps(size, True) if val is not None else None, callbacks=callbacks,
                        verbose=0)
        record = _record(epoch, {k: v[-1] for k, v in fit.history.items()}, counter[0])
        record["steps_per_rank"] = hvd.allgather(tf.constant([counter[0]])).numpy().tolist()
        steps.append(counter[0])
        history.append(record)
        if rank == 0:
            _checkpoint(spec, model, epoch, history)
            if int(spec.params.get("verbose") or 0) > 0:
                log_to_driver(epoch_line(record, epochs))
    result: TrainResult = {"history": history, "steps": steps}
    if rank == 0:  # the weights only: the compiled model holds the distributed optimizer wrapper
        result["state"] = pickle.dumps(model.get_weights())
    return result

