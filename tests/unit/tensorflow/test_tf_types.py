"""phalanx.tensorflow.tf_types: TensorFlow and Keras ship no type information, so mypy cannot check that
their objects satisfy the Protocols phalanx annotates with; this checks every member against real objects."""

from __future__ import annotations

import inspect

import pytest

pytest.importorskip("tensorflow")

import keras
import tensorflow as tf

from phalanx.tensorflow import tf_types


def _members(protocol: type) -> set[str]:
    """The names a Protocol declares, its own and its base Protocols' (methods, properties, attributes)."""
    names: set[str] = set()
    for cls in protocol.__mro__:
        if cls in (object,) or not getattr(cls, "_is_protocol", False) or cls.__module__ == "typing":
            continue
        names |= {n for n in vars(cls) if not n.startswith("_")} | set(getattr(cls, "__annotations__", {}))
    return names


def _model() -> keras.Model:
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    model.compile(optimizer="sgd", loss="mse")
    return model


def _built_optimizer() -> keras.optimizers.Optimizer:
    optimizer = keras.optimizers.SGD(momentum=0.9)
    optimizer.build(_model().trainable_variables)
    return optimizer


def _cases() -> list[tuple[type, object]]:
    from phalanx.torch.elastic import State

    tf_variable = tf.Variable([1.0, 2.0])
    return [
        (tf_types.VariableLike, tf_variable),
        (tf_types.VariableLike, keras.Variable([1.0, 2.0])),
        (tf_types.ReferableVariable, tf_variable),
        (tf_types.VariableRef, tf_variable.ref()),
        (tf_types.KerasModelLike, _model()),
        (tf_types.KerasOptimizerLike, _built_optimizer()),
        (tf_types.CommittableState, State),
    ]


def test_real_objects_have_every_member_of_their_protocol() -> None:
    for protocol, obj in _cases():
        members = _members(protocol)
        assert members, protocol
        missing = sorted(m for m in members if not hasattr(obj, m))
        assert not missing, f"{type(obj).__name__} lacks {missing} of {protocol.__name__}"
        for name in members & {n for n in vars(protocol) if inspect.isfunction(vars(protocol)[n])}:
            assert callable(getattr(obj, name)), f"{type(obj).__name__}.{name} is not callable"


def test_a_keras_variable_has_no_ref() -> None:
    """Why phalanx keys variables by ``ref()`` only where there is one (``var_key``)."""
    assert not hasattr(keras.Variable(1.0), "ref")


def test_every_protocol_is_checked() -> None:
    protocols = {obj for obj in vars(tf_types).values() if isinstance(obj, type)
                 and getattr(obj, "_is_protocol", False) and obj.__module__ == tf_types.__name__}
    assert protocols == {protocol for protocol, _ in _cases()}
