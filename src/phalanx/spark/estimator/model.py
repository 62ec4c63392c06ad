"""The Spark ML ``Model`` an estimator's ``fit`` returns: ``transform``, ``getHistory``, save and load.

``save(path)`` writes Spark ML's metadata (``path/metadata``, as ``DefaultParamsWriter`` does, so a
``Pipeline`` holding the model saves and loads it) and ``path/model.pkl``: the parameters, with the
framework's model as its own bytes. ``load`` unpickles that file: load only models you trust (as with
``torch.load``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import cloudpickle
from pyspark.ml import Model
from pyspark.ml.util import DefaultParamsReader, DefaultParamsWriter, MLReadable, MLReader, MLWritable, MLWriter

from phalanx.spark.estimator.params import add_params
from phalanx.spark.estimator.schema import ColumnSpec
from phalanx.spark.estimator.transform import Predictor, transform

if TYPE_CHECKING:
    from pyspark.sql import DataFrame

MODEL_PARAMS: dict[str, tuple[object, str]] = {
    "history": ([], "per-epoch metrics: [{'epoch', 'train': {...}, 'validation': {...}, 'steps'}]"),
    "model": (None, "the trained model"),
    "feature_columns": (None, "feature column names"),
    "label_columns": (None, "label column names"),
    "output_cols": (None, "output column names (default: '<label>__output')"),
    "run_id": (None, "the run's id in the store"),
    "input_shapes": (None, "shape of each input"),
    "feature_specs": (None, "the feature columns as trained on"),
    "output_sizes": (None, "values per row of each output"),
    "vector_outputs": (None, "whether each output is a DenseVector (its label was a vector)"),
}
_MODEL_FILE = "model.pkl"


class PhalanxModel(Model, MLWritable, MLReadable):
    """A trained model as a Spark ML ``Transformer`` (the framework subclass serializes its model)."""

    def __init__(self, **kwargs: Any) -> None:  # Spark ML params: the trained model among them
        super().__init__()
        self._setDefault(**{name: default for name, (default, _) in MODEL_PARAMS.items()})
        self._set(**kwargs)
        if self.getOrDefault("output_cols") is None and kwargs.get("label_columns"):
            self._set(output_cols=[f"{c}__output" for c in kwargs["label_columns"]])

    # -- the framework's part ---------------------------------------------------------------------------
    def model_bytes(self) -> bytes:
        """The model as bytes (framework-specific)."""
        raise NotImplementedError

    @classmethod
    def model_from_bytes(cls, data: bytes) -> object:
        """The inverse of :meth:`model_bytes`."""
        raise NotImplementedError

    def predictor_factory(self) -> Callable[[], Predictor]:
        """A picklable no-argument callable that builds a :data:`Predictor` on an executor."""
        raise NotImplementedError

    # -- transform ------------------------------------------------------------------------------------
    def _transform(self, dataset: DataFrame) -> DataFrame:
        specs: list[ColumnSpec] = self.getOrDefault("feature_specs")
        outputs = list(zip(self.getOrDefault("output_cols"), self.getOrDefault("output_sizes"),
                           self.getOrDefault("vector_outputs")))
        return transform(dataset, specs, outputs, self.predictor_factory())

    # -- persistence ----------------------------------------------------------------------------------
    def write(self) -> MLWriter:
        """A writer for ``save(path)``."""
        return _Writer(self)

    @classmethod
    def read(cls) -> MLReader:
        """A reader for ``load(path)``."""
        return _Reader(cls)

    def _state(self) -> dict[str, object]:
        state = {name: self.getOrDefault(getattr(self, name)) for name in MODEL_PARAMS if name != "model"}
        return {**state, "model": self.model_bytes()}


add_params(PhalanxModel, MODEL_PARAMS)


class _Writer(MLWriter):
    def __init__(self, instance: PhalanxModel) -> None:
        super().__init__()
        self.instance = instance

    def saveImpl(self, path: str) -> None:
        import fsspec

        json_params = {"feature_columns": self.instance.getOrDefault("feature_columns"),
                       "output_cols": self.instance.getOrDefault("output_cols")}
        DefaultParamsWriter.saveMetadata(self.instance, path, self.sc, paramMap=json_params)
        with fsspec.open(_join(path, _MODEL_FILE), "wb") as f:
            f.write(cloudpickle.dumps(self.instance._state()))


class _Reader(MLReader):
    def __init__(self, cls: type[PhalanxModel]) -> None:
        super().__init__()
        self.cls = cls

    def load(self, path: str) -> PhalanxModel:
        import fsspec

        DefaultParamsReader.loadMetadata(path, self.sc, self.cls.__module__ + "." + self.cls.__name__)
        with fsspec.open(_join(path, _MODEL_FILE), "rb") as f:
            state = cloudpickle.loads(f.read())
        state["model"] = self.cls.model_from_bytes(state["model"])
        return self.cls(**state)


def _join(path: str, name: str) -> str:
    return f"{path.rstrip('/')}/{name}"
