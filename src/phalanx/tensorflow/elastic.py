"""Elastic training for TensorFlow (Horovod's ``horovod.tensorflow.elastic``): lose a rank, keep the work.

The machinery is ``phalanx.torch.elastic``'s (one process state, one driver protocol); these states hold
TensorFlow variables and Keras models. ``run`` also turns the ``OpError`` TensorFlow raises around a failed
collective inside a graph back into the collective's own exception, which is how the elastic loop tells a
lost peer from a bug. Launch with ``phalanx.run(fn, np=N, min_np=A, max_np=B)`` or ``phalanxrun --min-np``.

``Any`` stays where the base class (``phalanx.torch.elastic.ObjectState``) has it: ``**kwargs`` are the user's
own state attributes (and ``ObjectState``'s options), ``load_durable`` takes a checkpoint as ``torch.load``
read it back.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import numpy as np
import tensorflow as tf
import torch

from phalanx.tensorflow import _bridge, keras_flavour
from phalanx.tensorflow.ops import broadcast_variables
from phalanx.tensorflow.tf_types import KerasModelLike, KerasOptimizerLike, VariableLike
from phalanx.torch.elastic import ObjectState
from phalanx.torch.elastic import run as _torch_run

Result = TypeVar("Result")


def _snapshot(variables: Sequence[VariableLike]) -> list[np.ndarray]:
    return [np.array(v.numpy(), copy=True) for v in variables]


def _assign(variables: Sequence[VariableLike], values: Sequence[np.ndarray]) -> None:
    for v, value in zip(variables, values):
        v.assign(np.asarray(value))


def _as_tensors(arrays: list[np.ndarray]) -> list[torch.Tensor]:
    """Durable form: torch tensors, which a ``weights_only`` checkpoint load accepts."""
    return [torch.from_numpy(np.ascontiguousarray(a)) for a in arrays]


class TensorFlowState(ObjectState):
    """TensorFlow variables and plain attributes (Horovod's ``TensorFlowState``).

    Args:
        variables: the variables to keep (TensorFlow 2: pass them; there is no global collection).
        session: TensorFlow 1's session; accepted and unused (TensorFlow 2 runs eagerly).
        **kwargs: plain attributes (``epoch=0, batch=0``), as in ``ObjectState``.
    """

    def __init__(self, variables: Sequence[VariableLike] | None = None, session: object = None,
                 **kwargs: Any) -> None:
        del session
        self.variables = list(variables) if variables is not None else []
        self._saved_values: list[np.ndarray] = []
        super().__init__(**kwargs)
        self.save()  # the initial values are the first commit, as in Horovod

    def save(self) -> None:
        """Copy the variables' values and the attributes."""
        self._saved_values = _snapshot(self.variables)
        super().save()

    def restore(self) -> None:
        """Assign the last saved values back."""
        _assign(self.variables, self._saved_values)
        super().restore()

    def sync(self) -> None:
        """Every rank takes rank 0's values (one broadcast per dtype) and attributes, and saves the values."""
        broadcast_variables(self.variables, root_rank=0, name="elastic.TensorFlowState")
        self._saved_values = _snapshot(self.variables)  # Horovod's sync saves: restore() keeps rank 0's values
        super().sync()

    def durable(self) -> dict[str, object]:
        """The variables and attributes as last committed."""
        return {"variables": _as_tensors(self._saved_values), **super().durable()}

    def load_durable(self, value: dict[str, Any]) -> None:
        """Assign a checkpoint's values."""
        if value.get("variables"):
            _assign(self.variables, [t.numpy() for t in value["variables"]])
        super().load_durable(value)


class TensorFlowKerasState(ObjectState):
    """A Keras model, its optimizer and plain attributes (Horovod's ``TensorFlowKerasState``).

    Args:
        model: a built Keras model.
        optimizer: its optimizer (default: ``model.optimizer``); built on the model's trainable variables
            when it is not yet, so every rank syncs the same optimizer variables.
        backend: Keras' backend in Horovod; accepted and unused.
        **kwargs: plain attributes (``epoch=0, batch=0``), as in ``ObjectState``.
    """

    def __init__(self, model: KerasModelLike, optimizer: KerasOptimizerLike | None = None, backend: object = None,
                 **kwargs: Any) -> None:
        del backend
        self.model = model
        self.optimizer: KerasOptimizerLike | None = (
            optimizer if optimizer is not None else getattr(model, "optimizer", None))
        self._weights: list[np.ndarray] = []
        self._opt_values: list[np.ndarray] = []
        super().__init__(**kwargs)
        self.save()  # the initial values are the first commit, as in Horovod

    def _optimizer_variables(self) -> list[VariableLike]:
        if self.optimizer is None:
            return []
        return keras_flavour.optimizer_variables(self.optimizer, build_on=self.model.trainable_variables)

    def save(self) -> None:
        """Copy the model's weights, the optimizer's variables and the attributes."""
        self._weights = _snapshot(list(self.model.weights))
        self._opt_values = _snapshot(self._optimizer_variables())
        super().save()

    def restore(self) -> None:
        """Assign the last saved weights and optimizer variables back."""
        _assign(list(self.model.weights), self._weights)
        _assign(self._optimizer_variables(), self._opt_values)
        super().restore()

    def sync(self) -> None:
        """Every rank takes rank 0's weights, optimizer variables and attributes, and saves them."""
        broadcast_variables(list(self.model.weights), root_rank=0, name="elastic.KerasState.model")
        broadcast_variables(self._optimizer_variables(), root_rank=0, name="elastic.KerasState.optimizer")
        self._weights = _snapshot(list(self.model.weights))  # Horovod's sync saves: restore() keeps rank 0's
        self._opt_values = _snapshot(self._optimizer_variables())
        super().sync()

    def durable(self) -> dict[str, object]:
        """Weights, optimizer variables and attributes as last committed."""
        return {"model": _as_tensors(self._weights), "optimizer": _as_tensors(self._opt_values),
                **super().durable()}

    def load_durable(self, value: dict[str, Any]) -> None:
        """Assign a checkpoint's weights and optimizer variables."""
        if value.get("model"):
            _assign(list(self.model.weights), [t.numpy() for t in value["model"]])
        if value.get("optimizer"):
            _assign(self._optimizer_variables(), [t.numpy() for t in value["optimizer"]])
        super().load_durable(value)


def _unwrapped(func: Callable[..., Result]) -> Callable[..., Result]:
    @functools.wraps(func)
    def call(*args: object, **kwargs: object) -> Result:
        try:
            return func(*args, **kwargs)
        except tf.errors.OpError as e:
            original = _bridge.take_error()
            if original is None:
                raise
            raise original from e

    return call


def run(func: Callable[..., Result]) -> Callable[..., Result]:
    """Decorate a training function ``func(state, *args, **kwargs)`` to survive lost ranks.

    As ``phalanx.torch.elastic.run``: sync the state from rank 0, call ``func``; when a collective fails
    because a peer died, restore the last commit, re-form the world, sync and call ``func`` again.
    """
    return _torch_run(_unwrapped(func))


__all__ = ["ObjectState", "TensorFlowKerasState", "TensorFlowState", "run"]
