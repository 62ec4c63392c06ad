"""``TorchEstimator`` and ``TorchModel``: Horovod's ``horovod.spark.torch`` on phalanx (no Petastorm)."""

from __future__ import annotations

import io
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import cloudpickle
import numpy as np

from phalanx.errors import InvalidArgumentError
from phalanx.spark.estimator.base import PhalanxEstimator, pickled
from phalanx.spark.estimator.job import TrainResult, TrainSpec
from phalanx.spark.estimator.model import PhalanxModel
from phalanx.spark.estimator.params import add_params
from phalanx.spark.estimator.schema import VECTOR, ColumnSpec, Shapes, row_shape
from phalanx.spark.estimator.transform import Predictor

if TYPE_CHECKING:
    import torch

TORCH_PARAMS: dict[str, tuple[object, str]] = {
    "input_shapes": (None, "shape of each input, the batch dimension first as -1"),
    "loss_constructors": (None, "functions that return the loss(es); instead of loss"),
    "train_minibatch_fn": (None, "not supported: phalanx runs the standard step"),
    "backward_passes_per_step": (1, "batches whose gradients are accumulated locally before each allreduce "
                                    "and optimizer step (the loss is divided by it, as in Horovod)"),
}


class TorchEstimator(PhalanxEstimator):
    """Spark ML ``Estimator`` that trains a PyTorch model on a DataFrame with ``phalanx.torch``.

    ``TorchEstimator(model=..., optimizer=..., loss=..., feature_cols=[...], label_cols=[...],
    input_shapes=[...], batch_size=32, epochs=1, store=..., num_proc=...).fit(df)`` returns a
    :class:`TorchModel`. Every parameter of ``horovod.spark.torch.TorchEstimator`` is accepted, with its
    default; ``docs/estimators.md`` gives them and docs/migration.md the differences.

    ``optimizer`` is an instance built over ``model.parameters()`` (it travels with the model, its
    hyperparameters and state included); each rank wraps it in ``hvd.DistributedOptimizer``.
    """

    framework = "pytorch"

    @classmethod
    def extra_params(cls) -> dict[str, tuple[object, str]]:
        """``input_shapes``, ``loss_constructors``, ``train_minibatch_fn``, ``backward_passes_per_step``."""
        return TORCH_PARAMS

    def check_framework(self, values: dict[str, Any]) -> None:
        """``model`` a ``torch.nn.Module``, ``optimizer`` a ``torch.optim.Optimizer`` over its parameters,
        exactly one of ``loss`` / ``loss_constructors``."""
        import torch

        if not isinstance(values["model"], torch.nn.Module):
            raise InvalidArgumentError(f"model={type(values['model']).__name__}: give a torch.nn.Module")
        optimizer = values.get("optimizer")
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise InvalidArgumentError(
                f"optimizer={optimizer!r}: give a torch.optim.Optimizer built over model.parameters()")
        owned = {id(p) for p in values["model"].parameters()}
        if any(id(p) not in owned for group in optimizer.param_groups for p in group["params"]):
            raise InvalidArgumentError("optimizer has parameters that are not the model's: build it over "
                                       "model.parameters()")
        if (values.get("loss") is None) == (values.get("loss_constructors") is None):
            raise InvalidArgumentError("give exactly one of loss= and loss_constructors=")
        passes = values.get("backward_passes_per_step")
        if isinstance(passes, bool) or not isinstance(passes, int) or passes < 1:
            raise InvalidArgumentError(f"backward_passes_per_step={passes!r}: give an int >= 1")
        if values.get("train_minibatch_fn") is not None:
            raise InvalidArgumentError("train_minibatch_fn is not supported by phalanx's TorchEstimator")
        if values.get("loss_constructors") is not None:
            ctors = values["loss_constructors"]
            values["loss"] = [c() for c in ctors] if isinstance(ctors, (list, tuple)) else ctors()

    def model_blob(self, values: dict[str, Any]) -> bytes:
        """The model and its optimizer, pickled together (the optimizer keeps pointing at the model)."""
        return pickled((values["model"], values["optimizer"]), "the model or optimizer")

    def remote(self) -> Callable[[TrainSpec], TrainResult]:
        """``torch_remote.train``."""
        from phalanx.spark.estimator.torch_remote import train

        return train

    def make_model(self, result: TrainResult, spec: TrainSpec) -> TorchModel:
        """A :class:`TorchModel` holding a copy of ``model`` with the trained weights."""
        return trained_model(self.getOrDefault("model"), result, spec)


add_params(TorchEstimator, TORCH_PARAMS)


def trained_model(module: torch.nn.Module, result: TrainResult, spec: TrainSpec) -> TorchModel:
    """A :class:`TorchModel` holding a copy of ``module`` (a ``torch.nn.Module``, a ``LightningModule`` too)
    with rank 0's trained weights from ``result``, in eval mode."""
    import copy

    import torch

    model = copy.deepcopy(module)
    model.load_state_dict(torch.load(io.BytesIO(result["state"]), weights_only=True))
    model.eval()
    features = list(spec.data.features)
    shapes = spec.params.get("input_shapes")
    sizes = _output_sizes(model, features, shapes)
    vectors = [label.kind == VECTOR for label in spec.data.labels] + [False] * len(sizes)
    return TorchModel(history=result["history"], model=model, feature_columns=[c.name for c in features],
                      label_columns=[c.name for c in spec.data.labels], run_id=spec.run_id, input_shapes=shapes,
                      feature_specs=features, output_sizes=sizes, vector_outputs=vectors[:len(sizes)])


def _output_sizes(model: torch.nn.Module, specs: list[ColumnSpec], shapes: Shapes | None) -> list[int]:
    predict = _TorchPredictor(model, specs, shapes)
    return [int(np.prod(out.shape[1:])) for out in predict([np.zeros((1, s.size), np.float32) for s in specs])]


class _TorchPredictor:
    def __init__(self, model: torch.nn.Module, specs: list[ColumnSpec], shapes: Shapes | None) -> None:
        self.model, self.specs, self.shapes = model, specs, shapes

    def __call__(self, inputs: list[np.ndarray]) -> list[np.ndarray]:
        import torch

        tensors = [torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32)).reshape(
            len(x), *row_shape(s, self.shapes[i] if self.shapes else None)) for i, (x, s) in
            enumerate(zip(inputs, self.specs))]
        with torch.no_grad():
            out = self.model(*tensors)
        outs = list(out) if isinstance(out, (list, tuple)) else [out]
        return [o.detach().cpu().numpy().reshape(len(inputs[0]), -1) for o in outs]


class _TorchPredictorFactory:
    """Carries the model's bytes to the executors and builds the predictor there, once per task."""

    def __init__(self, blob: bytes, specs: list[ColumnSpec], shapes: Shapes | None) -> None:
        self.blob, self.specs, self.shapes = blob, specs, shapes

    def __call__(self) -> Predictor:
        model = cloudpickle.loads(self.blob)
        model.eval()
        return _TorchPredictor(model, self.specs, self.shapes)


class TorchModel(PhalanxModel):
    """Spark ML ``Transformer`` wrapping a trained PyTorch model (``getModel()``); ``transform(df)`` adds
    ``<label>__output`` columns, computed on the executors."""

    def model_bytes(self) -> bytes:
        """The model, pickled."""
        return bytes(cloudpickle.dumps(self.getOrDefault("model")))

    @classmethod
    def model_from_bytes(cls, data: bytes) -> torch.nn.Module:
        """The model from :meth:`model_bytes`."""
        return cloudpickle.loads(data)

    def predictor_factory(self) -> Callable[[], Predictor]:
        """Builds the predictor on the executor."""
        return _TorchPredictorFactory(self.model_bytes(), self.getOrDefault("feature_specs"),
                                      self.getOrDefault("input_shapes"))
