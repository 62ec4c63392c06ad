"""Which Keras phalanx.tensorflow(.keras) works with: the one ``tf.keras`` is, as TensorFlow chose it.

TensorFlow 2.16+ routes ``tf.keras`` to Keras 3 (the ``keras`` package), or to Keras 2 (the ``tf_keras``
package) when ``TF_USE_LEGACY_KERAS`` is ``1``/``true``/``True`` and ``tf_keras`` is installed. phalanx asks
TensorFlow instead of re-reading the variable, so both always agree, also when the variable changed after
TensorFlow made its choice (TensorFlow chooses once per process, at the first use of ``tf.keras``). A Keras
2 ``keras`` package (TensorFlow 2.15 and older) is Keras 2 too.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Sequence
from types import ModuleType
from typing import Any


@functools.cache
def keras() -> ModuleType:
    """The Keras package ``tf.keras`` is: ``keras`` (Keras 3) or ``tf_keras`` (Keras 2)."""
    import tensorflow as tf

    package = tf.keras.Model.__module__.split(".", 1)[0]
    return importlib.import_module(package)


def is_keras3() -> bool:
    """Whether ``tf.keras`` is Keras 3 (else Keras 2: ``tf_keras``, or an old ``keras`` 2.x)."""
    return str(getattr(keras(), "__version__", "3")).startswith("3.")


def version_label() -> str:
    """``"Keras 3.15.1"`` / ``"tf_keras 2.21.0"``, for error messages."""
    module = keras()
    return f"{'Keras' if module.__name__ == 'keras' else module.__name__} {getattr(module, '__version__', '?')}"


def optimizer_classes() -> tuple[type, ...]:
    """The optimizer base classes ``DistributedOptimizer`` takes: Keras 3's, or Keras 2's new and legacy."""
    module = keras()
    legacy = getattr(module.optimizers, "legacy", None)
    legacy_base = getattr(legacy, "Optimizer", None) if not is_keras3() else None
    return (module.optimizers.Optimizer,) + ((legacy_base,) if isinstance(legacy_base, type) else ())


def loss_scale_optimizer_class() -> type:
    """``LossScaleOptimizer`` of this Keras (Keras 2's legacy and new loss-scale optimizers are instances)."""
    cls: type = keras().mixed_precision.LossScaleOptimizer
    return cls


def optimizer_variables(optimizer: Any, build_on: Sequence[Any] | None = None) -> list[Any]:
    """The optimizer's variables; with ``build_on``, its slots for those variables are created first.

    Keras 3 builds once (``built``); Keras 2's new optimizers' ``build`` and its legacy ones'
    ``_create_all_weights`` may be called again (they create only what is missing). A legacy optimizer's
    ``variables`` is a method, not a list.
    """
    if build_on is not None:
        import tensorflow as tf

        with tf.init_scope():
            if hasattr(optimizer, "_create_all_weights"):
                optimizer._create_all_weights(list(build_on))
            elif not getattr(optimizer, "built", False):
                optimizer.build(list(build_on))
    found = optimizer.variables
    return list(found if isinstance(found, (list, tuple)) else found())
