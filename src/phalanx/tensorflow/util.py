"""``horovod.tensorflow.util``: Horovod's small TensorFlow helpers, which its tests and user code import.

``_executing_eagerly`` is also ``hvd._executing_eagerly``. TensorFlow 2 always has eager execution, so
``_has_eager`` is True.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable
from typing import TypeVar

import tensorflow as tf

from phalanx.tensorflow.tf_types import ReferableVariable, VariableLike, VariableRef

_has_eager = True

T = TypeVar("T")


def _executing_eagerly() -> bool:
    """Whether TensorFlow runs ops eagerly here (False while a graph or a ``tf.function`` is built)."""
    return bool(tf.executing_eagerly())


def _make_subgraph(f: Callable[..., T]) -> Callable[..., T]:
    """``f`` as a ``tf.function`` (a graph TensorFlow traces once per input signature)."""
    return tf.function(f)


def _cache(f: Callable[..., T]) -> Callable[..., T]:
    """Memoize ``f`` on its (hashable) arguments and on whether TensorFlow runs eagerly, as Horovod does
    for the functions that build its broadcast subgraphs."""
    cache: dict[tuple[Hashable, ...], T] = {}

    def wrapper(*args: Hashable) -> T:
        key = (args, _executing_eagerly())
        if key not in cache:
            cache[key] = f(*args)
        return cache[key]

    return wrapper


def vars_to_refs(variables: Iterable[ReferableVariable]) -> list[VariableRef]:
    """Hashable references of ``variables`` (``v.ref()``), usable as dict keys and set members."""
    return [v.ref() for v in variables]


def refs_to_vars(refs: Iterable[VariableRef]) -> list[VariableLike]:
    """The variables behind references from :func:`vars_to_refs`."""
    return [r.deref() for r in refs]
