"""``KerasEstimator`` and ``KerasModel``: Horovod's ``horovod.spark.keras`` on phalanx (no Petastorm)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import cloudpickle
import numpy as np

from phalanx.errors import InvalidArgumentError, PayloadError
from phalanx.spark.estimator.base import PhalanxEstimator
from phalanx.spark.estimator.job import TrainResult, TrainSpec
from phalanx.spark.estimator.model import PhalanxModel
from phalanx.spark.estimator.params import add_params
from phalanx.spark.estimator.schema import VECTOR, ColumnSpec, Shapes
from phalanx.spark.estimator.transform import Predictor

if TYPE_CHECKING:
    import keras

KERAS_PARAMS: dict[str, tuple[object, str]] = {
    "input_shapes": (None, "shape of each input (default: the model's input shapes)"),
    "custom_objects": ({}, "custom Keras objects the model needs to load"),
    "checkpoint_callback": (None, "ignored: phalanx checkpoints every epoch into the store"),
    "backend_env": (None, "ignored: use the ranks' env of phalanx.spark.run"),
    "tensorflow_dataset_prefetch_buffer_size": (None, "batches each rank reads ahead on a background thread "
                                                      "while the model trains (None or 0: none)"),
}


class KerasEstimator(PhalanxEstimator):
    """Spark ML ``Estimator`` that trains a Keras model on a DataFrame with ``phalanx.tensorflow.keras``.

    ``KerasEstimator(model=..., optimizer=keras.optimizers.Adam(...), loss=..., metrics=[...],
    feature_cols=[...], label_cols=[...], batch_size=32, epochs=1, store=..., num_proc=...).fit(df)``
    returns a :class:`KerasModel`. Each rank wraps the optimizer in ``hvd.DistributedOptimizer``, compiles
    the model and fits one epoch at a time on its shard (NumPy batches).
    """

    framework = "keras"

    @classmethod
    def extra_params(cls) -> dict[str, tuple[object, str]]:
        """``input_shapes``, ``custom_objects``, ``checkpoint_callback``, ``backend_env``,
        ``tensorflow_dataset_prefetch_buffer_size``."""
        return KERAS_PARAMS

    def check_framework(self, values: dict[str, Any]) -> None:
        """``model`` a ``tf.keras.Model`` and ``optimizer`` a ``tf.keras`` optimizer, of the Keras ``tf.keras``
        is (Keras 3, or ``tf_keras`` under ``TF_USE_LEGACY_KERAS=1``), and a ``loss``."""
        from phalanx.tensorflow import keras_flavour

        keras, label = keras_flavour.keras(), keras_flavour.version_label()
        if not isinstance(values["model"], keras.Model):
            raise InvalidArgumentError(
                f"model={_class_name(values['model'])}: give a {keras.__name__}.Model (tf.keras is {label}: "
                f"{_FLAVOUR_HINT})")
        if not isinstance(values.get("optimizer"), keras_flavour.optimizer_classes()):
            raise InvalidArgumentError(
                f"optimizer={_class_name(values.get('optimizer'))}: give a {keras.__name__}.optimizers optimizer "
                f"instance (tf.keras is {label}: {_FLAVOUR_HINT})")
        if values.get("loss") is None:
            raise InvalidArgumentError("loss=None: give the Keras loss (a name, a function or a Loss object)")
        depth = values.get("tensorflow_dataset_prefetch_buffer_size")
        if depth is not None and (isinstance(depth, bool) or not isinstance(depth, int) or depth < 0):
            raise InvalidArgumentError(
                f"tensorflow_dataset_prefetch_buffer_size={depth!r}: give an int >= 0 (or None)")

    def model_blob(self, values: dict[str, Any]) -> bytes:
        """The model's ``.keras`` bytes, the optimizer's config, the loss and the metrics."""
        from phalanx.spark.estimator.keras_remote import keras_of, save_model

        keras = keras_of(values["model"])
        try:
            return bytes(cloudpickle.dumps({
                "model": save_model(values["model"]), "optimizer": keras.optimizers.serialize(values["optimizer"]),
                "loss": values["loss"], "metrics": values.get("metrics") or [],
                "custom_objects": values.get("custom_objects") or {}}))
        except Exception as e:
            raise PayloadError(f"the Keras model, loss or metrics cannot be serialized: {type(e).__name__}: {e}") from e

    def rank_env(self) -> dict[str, str]:
        """``TF_USE_LEGACY_KERAS`` for the model's Keras: every rank's ``tf.keras`` is the one that built it."""
        from phalanx.spark.estimator.keras_remote import keras_of, rank_env

        return rank_env(keras_of(self.getOrDefault("model")))

    def remote(self) -> Callable[[TrainSpec], TrainResult]:
        """``keras_remote.train``."""
        from phalanx.spark.estimator.keras_remote import train

        return train

    def make_model(self, result: TrainResult, spec: TrainSpec) -> KerasModel:
        """A :class:`KerasModel` holding the trained model."""
        import pickle

        from phalanx.spark.estimator.keras_remote import load_model, save_model

        custom = self.getOrDefault("custom_objects") or {}
        model = load_model(save_model(self.getOrDefault("model")), custom)
        model.set_weights(pickle.loads(result["state"]))
        blob = save_model(model)
        feature_specs = list(spec.data.features)
        shapes = spec.params.get("input_shapes")
        predict = _KerasPredictorFactory(blob, feature_specs, shapes, custom)()
        sizes = [int(np.prod(o.shape[1:])) for o in predict([np.zeros((1, s.size), np.float32) for s in feature_specs])]
        vectors = [label.kind == VECTOR for label in spec.data.labels] + [False] * len(sizes)
        labels = [c.name for c in spec.data.labels]
        return KerasModel(history=result["history"], model=model,
                          feature_columns=[c.name for c in feature_specs], label_columns=labels,
                          run_id=spec.run_id, input_shapes=shapes, feature_specs=feature_specs, output_sizes=sizes,
                          vector_outputs=vectors[:len(sizes)], custom_objects=custom)


add_params(KerasEstimator, KERAS_PARAMS)

_FLAVOUR_HINT = ("build the model and optimizer with tf.keras, or choose the Keras before TensorFlow is imported: "
                 "TF_USE_LEGACY_KERAS=1 for tf_keras (Keras 2), unset for Keras 3")


def _class_name(value: object) -> str:
    return f"{type(value).__module__}.{type(value).__qualname__}" if value is not None else "None"


class _KerasPredictorFactory:
    """Carries the model's ``.keras`` bytes to the executors and builds the predictor there."""

    def __init__(self, blob: bytes, specs: list[ColumnSpec], shapes: Shapes | None, custom: dict[str, object],
                 ) -> None:
        self.blob, self.specs, self.shapes, self.custom = blob, specs, shapes, custom

    def __call__(self) -> Predictor:
        from phalanx.spark.estimator.keras_remote import load_model, shaped

        model = load_model(self.blob, self.custom)
        shapes = self.shapes or [tuple(t.shape) for t in model.inputs]

        def predict(inputs: list[np.ndarray]) -> list[np.ndarray]:
            x = shaped([np.asarray(a, np.float32) for a in inputs], shapes)
            out = model(x[0] if len(x) == 1 else x, training=False)
            outs = list(out) if isinstance(out, (list, tuple)) else [out]
            return [np.asarray(o).reshape(len(inputs[0]), -1) for o in outs]

        return predict


class KerasModel(PhalanxModel):
    """Spark ML ``Transformer`` wrapping a trained Keras model (``getModel()``); ``transform(df)`` adds
    ``<label>__output`` columns, computed on the executors."""

    def __init__(self, custom_objects: dict[str, object] | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.custom_objects = dict(custom_objects or {})

    def model_bytes(self) -> bytes:
        """The model's ``.keras`` file."""
        from phalanx.spark.estimator.keras_remote import save_model

        return save_model(self.getOrDefault("model"))

    @classmethod
    def model_from_bytes(cls, data: bytes) -> keras.Model:
        """The model from :meth:`model_bytes` (custom objects must be registered with Keras)."""
        from phalanx.spark.estimator.keras_remote import load_model

        return load_model(data, None)

    def predictor_factory(self) -> Callable[[], Predictor]:
        """Builds the predictor on the executor."""
        return _KerasPredictorFactory(self.model_bytes(), self.getOrDefault("feature_specs"),
                                      self.getOrDefault("input_shapes"), self.custom_objects)
