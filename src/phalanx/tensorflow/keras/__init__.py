"""Horovod's Keras API for TensorFlow 2 / Keras 3: ``import phalanx.tensorflow.keras as hvd``.

Also importable, unchanged, as ``horovod.tensorflow.keras`` and ``horovod.keras``. Needs the optional extra
``phalanx[tensorflow]``. Gradients travel on phalanx.torch's collectives (one flat buffer per dtype per step,
through ``tf.numpy_function``); ``model.fit`` with a ``DistributedOptimizer`` runs with ``jit_compile=False``
and checks that every rank takes the same number of steps. See ``docs/tensorflow.md``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import keras

from phalanx.tensorflow import (
    Adasum,
    Average,
    Compression,
    Max,
    Min,
    ProcessSet,
    Product,
    Sum,
    allgather,
    allreduce,
    broadcast,
    broadcast_variables,
    cross_rank,
    cross_size,
    global_process_set,
    init,
    is_homogeneous,
    is_initialized,
    local_rank,
    local_size,
    mpi_built,
    mpi_enabled,
    mpi_threads_supported,
    rank,
    shutdown,
    size,
    start_timeline,
    stop_timeline,
)
from phalanx.tensorflow.compression import Compressor
from phalanx.tensorflow.keras import _patch, callbacks
from phalanx.tensorflow.keras.optimizer import DistributedOptimizer, Options, is_distributed, make_distributed_in_place
from phalanx.torch import _reduce as R

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


def load_model(filepath: str, custom_optimizers: Sequence[type] | None = None,
               custom_objects: dict[str, Any] | None = None, compression: type[Compressor] = Compression.none,
               op: int = R.Average, backward_passes_per_step: int = 1, average_aggregated_gradients: bool = False,
               compile: bool = True) -> Any:
    """Load a Keras model (``.keras`` / ``.h5``) and make its optimizer a ``DistributedOptimizer`` (state kept).

    Args:
        filepath: the saved model.
        custom_optimizers: optimizer classes the file refers to (added to ``custom_objects`` by name).
        custom_objects: as in ``keras.models.load_model``.
        compression: the distributed optimizer's compression.
        op: its reduce op.
        backward_passes_per_step: as in ``DistributedOptimizer``.
        average_aggregated_gradients: as in ``DistributedOptimizer``.
        compile: as in ``keras.models.load_model``.

    Returns:
        The model; when it was saved compiled, ``model.optimizer`` is distributed.
    """
    objects = dict(custom_objects or {})
    for cls in custom_optimizers or ():
        objects.setdefault(cls.__name__, cls)
    model = keras.models.load_model(filepath, custom_objects=objects, compile=compile)
    optimizer = getattr(model, "optimizer", None)
    if optimizer is not None and not is_distributed(optimizer):
        make_distributed_in_place(optimizer, Options(compression=compression, op=op,
                                                     backward_passes_per_step=backward_passes_per_step,
                                                     average_aggregated_gradients=average_aggregated_gradients))
        model.jit_compile = False
        _patch.remember(model)
    return model


__all__ = [
    "Adasum", "Average", "Compression", "DistributedOptimizer", "Max", "Min", "ProcessSet", "Product", "Sum",
    "allgather", "allreduce", "broadcast", "broadcast_global_variables", "broadcast_variables", "callbacks",
    "cross_rank", "cross_size", "global_process_set", "init", "is_homogeneous", "is_initialized", "load_model",
    "local_rank", "local_size", "mpi_built", "mpi_enabled", "mpi_threads_supported", "rank", "shutdown", "size",
    "start_timeline", "stop_timeline",
]  # fmt: skip
