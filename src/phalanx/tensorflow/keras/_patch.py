"""What ``model.compile`` and ``model.fit`` do differently when a model trains with a ``DistributedOptimizer``.

Installed once, when ``phalanx.tensorflow.keras`` is imported (``keras.Model`` is patched; a model without
a distributed optimizer is not affected, except that ``compile`` accepts and silently drops TF 1's
``experimental_run_tf_function`` argument, which Horovod's examples pass and Keras 3 refuses). ``keras`` here
is the Keras ``tf.keras`` is (``keras_flavour``): Keras 3, or Keras 2 (``tf_keras``):

* ``compile``: ``jit_compile`` is forced off (XLA cannot compile the ``tf.numpy_function`` bridge; Keras'
  ``"auto"`` turns it on when a GPU is visible); under the ``mixed_float16`` policy the optimizer becomes
  ``DistributedOptimizer(LossScaleOptimizer(...))`` instead of Keras' ``LossScaleOptimizer(Distributed...)``,
  so the overflow check sees averaged gradients; the model is remembered for
  ``broadcast_global_variables``.
* ``fit``: a first callback checks at the end of every epoch, and of training, that every rank took the
  same number of steps (a named collective that cannot match a gradient allreduce); a collective error
  raised inside the training graph is re-raised as a plain ``CollectiveMismatchError`` that says so, and
  any other collective failure as the collective's own exception (a lost peer's, which elastic training
  recognizes), not TensorFlow's ``OpError`` around it.
"""

from __future__ import annotations

import functools
import gc
import re
import warnings
import weakref
from typing import Any

import tensorflow as tf

from phalanx.errors import CollectiveMismatchError
from phalanx.tensorflow import _bridge, keras_flavour
from phalanx.tensorflow.keras import optimizer as keras_optimizer

DROPPED_COMPILE_ARGS = ("experimental_run_tf_function",)
STEPS_ADVICE = (
    "Ranks ran different numbers of training steps. Every rank must take the same number of steps per epoch "
    "and the same number of epochs: pass the same steps_per_epoch to model.fit on every rank (e.g. "
    "steps_per_epoch = len(x_train) // (batch_size * hvd.size())) and make sure each rank's dataset yields "
    "at least that many batches"
)
_MODELS: list[weakref.ref[Any]] = []  # compile order; weak: a model dropped by the user is forgotten
_ORIGINAL: dict[str, Any] = {}
keras: Any = keras_flavour.keras()


class _StepAgreement(keras.callbacks.Callback):
    """Checks, with one small collective at each epoch's end and at the end of training, that ranks agree."""

    def __init__(self) -> None:
        super().__init__()
        self._last_batch = -1
        self._epochs = 0

    def on_epoch_begin(self, epoch: int, logs: Any = None) -> None:
        self._last_batch = -1

    def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
        self._last_batch = batch

    def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
        self._epochs += 1
        _agree(f"model.fit end of epoch {epoch + 1} after {self._last_batch + 1} steps")

    def on_train_end(self, logs: Any = None) -> None:
        _agree(f"model.fit end of training after {self._epochs} epochs")


def _agree(label: str) -> None:
    # The name differs from the gradient buffers' and from other epochs', so a rank that is still taking
    # steps meets it with a gradient allreduce: a mismatch on every rank, reported with both names.
    import numpy as np

    try:
        _bridge.np_allgather(np.zeros(1, dtype=np.int64), label)
    except CollectiveMismatchError as e:
        raise CollectiveMismatchError(f"{STEPS_ADVICE}. {e}") from None


def explain(error: BaseException) -> CollectiveMismatchError | None:
    """The clean error behind a TF ``OpError`` raised by a collective in the training graph, or None."""
    text = str(error)
    if _bridge.ERROR_MARK not in text:
        return None
    detail = text.split(_bridge.ERROR_MARK, 1)[1].strip().splitlines()[0].strip()
    detail = re.sub(r"\s*\[\[.*$", "", detail)
    if "model.fit end of" in detail:
        return CollectiveMismatchError(f"{STEPS_ADVICE}. {detail}")
    return CollectiveMismatchError(detail)


def _compile(self: Any, optimizer: Any = "rmsprop", *args: Any, **kwargs: Any) -> Any:
    for arg in DROPPED_COMPILE_ARGS:  # a no-op in both Kerases: dropped silently, as Horovod's examples pass it
        kwargs.pop(arg, None)
    optimizer = _distributed_outside(optimizer)
    if keras_optimizer.is_distributed(optimizer):
        if kwargs.get("jit_compile") is True:
            warnings.warn("jit_compile=True is turned off: XLA cannot compile phalanx's allreduce bridge",
                          stacklevel=2)
        kwargs["jit_compile"] = False
        optimizer = _loss_scaled(self, optimizer, kwargs.get("auto_scale_loss", True))
    result = _ORIGINAL["compile"](self, optimizer, *args, **kwargs)
    if keras_optimizer.is_distributed(getattr(self, "optimizer", None)):
        remember(self)
    return result


def remember(model: Any) -> None:
    """Record a model that trains with a distributed optimizer (for ``broadcast_global_variables``)."""
    if all(ref() is not model for ref in _MODELS):
        _MODELS.append(weakref.ref(model))


def live_models() -> list[Any]:
    """The remembered models that are still alive, in compile order (after a garbage collection, so that
    every rank that dropped the same models sees the same list)."""
    gc.collect()
    _MODELS[:] = [ref for ref in _MODELS if ref() is not None]
    return [m for m in (ref() for ref in _MODELS) if m is not None]


def _distributed_outside(optimizer: Any) -> Any:
    """``LossScaleOptimizer(DistributedOptimizer(x))`` built by hand -> ``DistributedOptimizer(LossScale(x))``."""
    inner = getattr(optimizer, "inner_optimizer", None)
    loss_scaled = keras_flavour.loss_scale_optimizer_class()
    if not isinstance(optimizer, loss_scaled) or not keras_optimizer.is_distributed(inner):
        return optimizer
    return keras_optimizer.with_options(keras_optimizer.plain_copy(optimizer), keras_optimizer.options_of(inner))


def _loss_scaled(model: Any, optimizer: Any, auto_scale_loss: bool) -> Any:
    """Under ``mixed_float16``, ``Distributed(LossScale(inner))`` instead of Keras' ``LossScale(Distributed)``."""
    policy = getattr(getattr(model, "dtype_policy", None), "name", "")
    loss_scaled = keras_flavour.loss_scale_optimizer_class()
    if not auto_scale_loss or policy != "mixed_float16" or isinstance(optimizer, loss_scaled):
        return optimizer
    scaled = loss_scaled(keras_optimizer.plain_copy(optimizer))
    return keras_optimizer.with_options(scaled, keras_optimizer.options_of(optimizer))


def _fit(self: Any, *args: Any, **kwargs: Any) -> Any:
    if not keras_optimizer.is_distributed(getattr(self, "optimizer", None)):
        return _ORIGINAL["fit"](self, *args, **kwargs)
    if len(args) > 5:  # fit(x, y, batch_size, epochs, verbose, callbacks, ...)
        args = (*args[:5], [_StepAgreement(), *(args[5] or [])], *args[6:])
    else:
        kwargs["callbacks"] = [_StepAgreement(), *(kwargs.get("callbacks") or [])]
    try:
        return _ORIGINAL["fit"](self, *args, **kwargs)
    except tf.errors.OpError as e:
        clean = explain(e)
        if clean is not None:
            raise clean from e
        original = _bridge.take_error()
        if original is None:
            raise
        raise original from e


def install() -> None:
    """Patch ``compile`` and ``fit`` where ``keras.Model`` gets them from (idempotent).

    Patched on the defining class (Keras' ``Trainer`` / ``TensorFlowTrainer``), not on ``keras.Model``:
    Keras skips compiling a loaded model whose class's ``compile`` differs from ``Trainer.compile``.
    """
    if _ORIGINAL:
        return
    for name, wrapper in (("compile", _compile), ("fit", _fit)):
        owner = next(c for c in keras.Model.__mro__ if name in vars(c))
        original = vars(owner)[name]
        _ORIGINAL[name] = original
        setattr(owner, name, functools.wraps(original)(wrapper))
