"""Horovod's Keras API for TensorFlow 2: ``import phalanx.tensorflow.keras as hvd``.

It works with the Keras ``tf.keras`` is, as TensorFlow chose it: Keras 3, or Keras 2 (``tf_keras``) with
``TF_USE_LEGACY_KERAS=1`` (``keras_flavour``). Optimizers, callbacks and layers given to it must be that
Keras's.

Also importable, unchanged, as ``horovod.tensorflow.keras`` and ``horovod.keras``. Needs the optional extra
``phalanx[tensorflow]``. Gradients travel on phalanx.torch's collectives (one flat buffer per dtype per step,
through ``tf.numpy_function``); ``model.fit`` with a ``DistributedOptimizer`` runs with ``jit_compile=False``
and checks that every rank takes the same number of steps. See ``docs/tensorflow.md``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from phalanx.errors import InvalidArgumentError
from phalanx.tensorflow import (
    Adasum,
    Average,
    Compression,
    Max,
    Min,
    ProcessSet,
    Product,
    Sum,
    add_process_set,
    broadcast_variables,
    ccl_built,
    cross_rank,
    cross_size,
    cuda_built,
    ddl_built,
    global_process_set,
    gloo_built,
    gloo_enabled,
    init,
    is_homogeneous,
    is_initialized,
    keras_flavour,
    local_rank,
    local_size,
    mpi_built,
    mpi_enabled,
    mpi_threads_supported,
    nccl_built,
    rank,
    remove_process_set,
    rocm_built,
    shutdown,
    size,
    start_timeline,
    stop_timeline,
)
from phalanx.tensorflow import collectives as _collectives
from phalanx.tensorflow import ops as _ops
from phalanx.tensorflow.compression import Compressor
from phalanx.tensorflow.keras import _patch, callbacks, elastic
from phalanx.tensorflow.keras.optimizer import (
    DistributedOptimizer,
    Options,
    PartialDistributedOptimizer,
    is_distributed,
    make_distributed_in_place,
)
from phalanx.torch import frontend as reduce_ops

if TYPE_CHECKING:
    import tensorflow as tf

keras: Any = keras_flavour.keras()
if keras.backend.backend() != "tensorflow":
    raise ImportError(f"phalanx.tensorflow.keras needs Keras' TensorFlow backend; KERAS_BACKEND is "
                      f"{keras.backend.backend()!r}: unset it or set KERAS_BACKEND=tensorflow")
_patch.install()


def broadcast_global_variables(root_rank: int) -> None:
    """Broadcast the variables of every model compiled with a ``DistributedOptimizer`` in this process.

    Keras 3 keeps no global variable collection; phalanx's meaning of "global" is the variables of every
    such model that is still alive, and its optimizer's, in compile order (call it after the models are
    built, e.g. after a first batch; ``callbacks.BroadcastGlobalVariablesCallback`` does that in ``fit``).

    Args:
        root_rank: the global rank whose values win.
    """
    models = _patch.live_models()
    variables: list[Any] = []
    for model in models:
        variables.extend(callbacks.model_variables(model))
    broadcast_variables(variables, root_rank, name=f"broadcast_global_variables of {len(models)} models")


def allreduce(value: object, name: str | None = None, average: bool | None = None, prescale_factor: float = 1.0,
              postscale_factor: float = 1.0, op: int | None = None,
              compression: type[Compressor] = Compression.none) -> tf.Tensor | tf.IndexedSlices:
    """Allreduce a tensor-compatible value (Horovod-Keras' ``allreduce``; ``Average`` by default).

    Args:
        value: a tensor, variable or array-like, the same shape on every rank.
        name: optional name, shown in errors.
        average: deprecated; True means ``op=Average``, False ``op=Sum``.
        prescale_factor: multiply inputs by this before reducing.
        postscale_factor: multiply the result by this.
        op: ``Average``, ``Sum``, ``Min``, ``Max`` or ``Product``.
        compression: ``Compression.none`` or ``Compression.fp16``.
    """
    return _ops.allreduce(value, average=average, compression=compression, op=op, prescale_factor=prescale_factor,
                          postscale_factor=postscale_factor, name=name)


def allgather(value: object, name: str | None = None) -> tf.Tensor:
    """Concatenate every rank's value along dim 0 (dim 0 may differ between ranks)."""
    return _collectives.allgather(value, name=name)


def broadcast(value: object, root_rank: int, name: str | None = None) -> tf.Tensor:
    """``root_rank``'s value on every rank."""
    return _collectives.broadcast(value, root_rank, name=name)


def reducescatter(value: object, name: str | None = None, op: int = reduce_ops.Average) -> tf.Tensor:
    """Reduce a value across ranks and keep this rank's block of dim 0."""
    return _collectives.reducescatter(value, name=name, op=op)


def load_model(filepath: str, custom_optimizers: Sequence[type] | None = None,
               custom_objects: dict[str, object] | None = None, compression: type[Compressor] = Compression.none,
               legacy_opts: bool = False, op: int = reduce_ops.Average, backward_passes_per_step: int = 1,
               average_aggregated_gradients: bool = False, compile: bool = True,
               ) -> Any:  # a model of the Keras tf.keras is at run time (Keras 3 or tf_keras)
    """Load a Keras model (``.keras`` / ``.h5``) and make its optimizer a ``DistributedOptimizer`` (state kept).

    Args:
        filepath: the saved model.
        custom_optimizers: optimizer classes the file refers to (added to ``custom_objects`` by name).
        custom_objects: as in ``keras.models.load_model``.
        compression: the distributed optimizer's compression.
        legacy_opts: Horovod's switch to ``tf.keras.optimizers.legacy``. Keras 2 (``tf_keras``) records in
            the file whether its optimizer is a legacy one and loads it as such: True checks that it is.
            Keras 3 has no legacy optimizers, so True raises there.
        op: its reduce op.
        backward_passes_per_step: as in ``DistributedOptimizer``.
        average_aggregated_gradients: as in ``DistributedOptimizer``.
        compile: as in ``keras.models.load_model``.

    Returns:
        The model; when it was saved compiled, ``model.optimizer`` is distributed.

    Raises:
        InvalidArgumentError: ``legacy_opts=True`` with Keras 3, or with a file whose optimizer is not legacy.
    """
    if legacy_opts and keras_flavour.is_keras3():
        raise InvalidArgumentError("load_model(legacy_opts=True) needs tf.keras.optimizers.legacy, which Keras 3 "
                                   "removed: save and load with Keras 3 optimizers (legacy_opts=False), or run "
                                   "with Keras 2 (pip install tf_keras; TF_USE_LEGACY_KERAS=1)")
    objects = dict(custom_objects or {})
    for cls in custom_optimizers or ():
        objects.setdefault(cls.__name__, cls)
    model = keras.models.load_model(filepath, custom_objects=objects, compile=compile)
    optimizer = getattr(model, "optimizer", None)
    if legacy_opts and optimizer is not None and not isinstance(optimizer, keras.optimizers.legacy.Optimizer):
        raise InvalidArgumentError(
            f"load_model(legacy_opts=True): {filepath} holds a {type(optimizer).__name__} that is not a "
            "tf.keras.optimizers.legacy one (Keras 2 loads the kind it saved): pass legacy_opts=False")
    if optimizer is not None and not is_distributed(optimizer):
        make_distributed_in_place(optimizer, Options(compression=compression, op=op,
                                                     backward_passes_per_step=backward_passes_per_step,
                                                     average_aggregated_gradients=average_aggregated_gradients))
        model.jit_compile = False
        _patch.remember(model)
    return model


__all__ = [
    "Adasum", "Average", "Compression", "DistributedOptimizer", "Max", "Min", "PartialDistributedOptimizer",
    "ProcessSet", "Product", "Sum", "add_process_set", "allgather", "allreduce", "broadcast",
    "broadcast_global_variables", "broadcast_variables", "callbacks", "ccl_built", "cross_rank", "cross_size",
    "cuda_built", "ddl_built", "elastic", "global_process_set", "gloo_built", "gloo_enabled", "init",
    "is_homogeneous", "is_initialized", "load_model", "local_rank", "local_size", "mpi_built", "mpi_enabled",
    "mpi_threads_supported", "nccl_built", "rank", "reducescatter", "remove_process_set", "rocm_built",
    "shutdown", "size", "start_timeline", "stop_timeline",
]
