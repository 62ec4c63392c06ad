"""Typed interfaces of the TensorFlow and Keras objects phalanx.tensorflow touches: what each caller uses of
them, so a signature says it (instead of ``Any``) and mypy checks phalanx's own use of them.

TensorFlow and Keras ship no type information (mypy sees their classes as ``Any``), so their conformance to
these Protocols is checked at test time instead, against the real classes and objects
(tests/unit/tensorflow/test_tf_types.py). Nothing here imports TensorFlow: these are annotations only.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol, TypeAlias

if TYPE_CHECKING:
    import numpy as np
    import tensorflow as tf

#: A variable's gradient: dense, sparse (``IndexedSlices``), or None for a variable the loss does not use.
Gradient: TypeAlias = "tf.Tensor | tf.IndexedSlices | None"


class VariableLike(Protocol):
    """``tf.Variable`` or ``keras.Variable``: a value read out as numpy and assigned in place."""

    def numpy(self) -> np.ndarray: ...

    def assign(self, value: object) -> object: ...



class VariableRef(Protocol):
    """What ``tf.Variable.ref()`` returns: a hashable stand-in for the variable."""

    def deref(self) -> VariableLike: ...


class ReferableVariable(VariableLike, Protocol):
    """A variable with ``ref()``: ``tf.Variable`` (a ``keras.Variable`` has none)."""

    def ref(self) -> VariableRef: ...


class KerasOptimizerLike(Protocol):
    """``keras.optimizers.Optimizer`` as elastic state sees it: its variables, built on the model's."""

    @property
    def variables(self) -> Sequence[VariableLike]: ...

    def build(self, variables: Sequence[VariableLike]) -> None: ...


class KerasModelLike(Protocol):
    """``keras.Model``: its weights (what elastic state saves) and trainable variables."""

    @property
    def weights(self) -> Sequence[VariableLike]: ...

    @property
    def variables(self) -> Sequence[VariableLike]: ...

    @property
    def trainable_variables(self) -> Sequence[VariableLike]: ...


class CommittableState(Protocol):
    """An elastic state (``phalanx.torch.elastic.State`` and its subclasses), as a commit callback uses it."""

    def commit(self) -> None: ...
