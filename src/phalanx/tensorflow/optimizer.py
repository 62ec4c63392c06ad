"""``horovod.tensorflow``'s ``DistributedOptimizer``, ``broadcast_global_variables`` and
``BroadcastGlobalVariablesHook`` (TensorFlow 1-style graphs through ``tf.compat.v1``, Keras 3 optimizers).

A Keras optimizer becomes ``phalanx.tensorflow.keras.DistributedOptimizer``'s; a ``tf.compat.v1.train``
optimizer is wrapped so that ``compute_gradients`` returns reduced gradients.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import tensorflow as tf

from phalanx.errors import InvalidArgumentError, UsageError
from phalanx.tensorflow._groups import GroupsOption
from phalanx.tensorflow._reduce_grads import GradReducer, make_reducer
from phalanx.tensorflow.compression import Compression, Compressor
from phalanx.tensorflow.gradient_aggregation import LocalGradientAggregationHelper
from phalanx.tensorflow.ops import broadcast_variables
from phalanx.tensorflow.tf_types import Gradient
from phalanx.torch import frontend as reduce_ops
from phalanx.torch.basics import rank
from phalanx.torch.process_sets import ProcessSet, global_process_set

if TYPE_CHECKING:
    import keras

_LegacyOptimizer: Any = tf.compat.v1.train.Optimizer


class _DistributedOptimizer(_LegacyOptimizer):
    """Wraps a ``tf.compat.v1.train.Optimizer``: ``compute_gradients`` reduces across ranks."""

    def __init__(self, optimizer: tf.compat.v1.train.Optimizer, reducer: GradReducer, name: str | None,
                 use_locking: bool, backward_passes_per_step: int, average_aggregated_gradients: bool) -> None:
        super().__init__(name=name or f"Distributed{type(optimizer).__name__}", use_locking=use_locking)
        self._optimizer = optimizer
        self._reducer = reducer
        self._agg_helper: LocalGradientAggregationHelper | None = None
        if backward_passes_per_step > 1:
            if tf.executing_eagerly():
                raise InvalidArgumentError("backward_passes_per_step > 1 is not yet supported for "
                                           "_LegacyOptimizer with eager execution.")
            self._agg_helper = LocalGradientAggregationHelper(
                backward_passes_per_step, reducer, reducer.sparse_as_dense, average_aggregated_gradients, rank(),
                LocalGradientAggregationHelper._OPTIMIZER_TYPE_LEGACY, reducer.process_set,
                reducer.scale_local_gradients, self.get_name())

    def register_local_var(self, var: object) -> None:
        """Leave ``var``'s gradient local (not reduced)."""
        if self._agg_helper is not None:
            self._agg_helper.register_local_var(var)
        self._reducer.register_local(var)

    def compute_gradients(self, *args: object, **kwargs: object) -> list[tuple[Gradient, tf.Variable]]:
        """The wrapped optimizer's gradients, reduced across the set's ranks."""
        pairs = self._optimizer.compute_gradients(*args, **kwargs)
        grads, variables = [g for g, _ in pairs], [v for _, v in pairs]
        if self._agg_helper is not None:
            reduced = self._agg_helper.compute_gradients(grads, variables)
        else:
            reduced = self._reducer(grads, variables)
        return list(zip(reduced, variables))

    def apply_gradients(self, grads_and_vars: Iterable[tuple[Gradient, tf.Variable]],
                        global_step: tf.Variable | None = None, name: str | None = None) -> tf.Operation:
        """The wrapped optimizer's ``apply_gradients`` (on the last pass of each step)."""
        def apply() -> tf.Operation:
            return self._optimizer.apply_gradients(grads_and_vars, global_step=global_step, name=name)

        if self._agg_helper is not None:
            return self._agg_helper.apply_gradients(apply, self._optimizer)
        return apply()

    def get_slot(self, *args: object, **kwargs: object) -> tf.Variable | None:
        """The wrapped optimizer's slot."""
        return self._optimizer.get_slot(*args, **kwargs)

    def get_slot_names(self, *args: object, **kwargs: object) -> list[str]:
        """The wrapped optimizer's slot names."""
        return self._optimizer.get_slot_names(*args, **kwargs)

    def variables(self, *args: object, **kwargs: object) -> list[tf.Variable]:
        """The wrapped optimizer's variables."""
        return self._optimizer.variables(*args, **kwargs)


def DistributedOptimizer(
    optimizer: keras.optimizers.Optimizer | tf.compat.v1.train.Optimizer, name: str | None = None,
    use_locking: bool = False, device_dense: str = "",
    device_sparse: str = "", compression: type[Compressor] = Compression.none, sparse_as_dense: bool = False,
    backward_passes_per_step: int = 1, op: int = reduce_ops.Average, gradient_predivide_factor: float = 1.0,
    average_aggregated_gradients: bool = False, num_groups: int = 0, groups: GroupsOption = None,
    process_set: ProcessSet = global_process_set, scale_local_gradients: bool = True,
) -> keras.optimizers.Optimizer | tf.compat.v1.train.Optimizer:
    """Wrap an optimizer so that it averages (``op``) gradients across ranks before applying them.

    Args:
        optimizer: a Keras optimizer of the Keras ``tf.keras`` is (Keras 3, or Keras 2's new or legacy
            ones; -> ``phalanx.tensorflow.keras.DistributedOptimizer``) or a
            ``tf.compat.v1.train.Optimizer``.
        (the others as in Horovod's ``horovod.tensorflow.DistributedOptimizer``; ``device_*`` are accepted
        and unused: tensors travel through host memory)

    Raises:
        InvalidArgumentError: neither kind of optimizer, or a bad option.
        NotImplementedError: ``op=Adasum``.
    """
    del device_dense, device_sparse
    from phalanx.tensorflow import keras_flavour

    if isinstance(optimizer, keras_flavour.optimizer_classes()):
        from phalanx.tensorflow.keras.optimizer import DistributedOptimizer as KerasDistributedOptimizer

        if op == reduce_ops.Adasum:
            raise InvalidArgumentError("op == Adasum is not supported yet with Keras")
        return KerasDistributedOptimizer(
            optimizer, name=name, compression=compression, sparse_as_dense=sparse_as_dense,
            gradient_predivide_factor=gradient_predivide_factor, op=op,
            backward_passes_per_step=backward_passes_per_step,
            average_aggregated_gradients=average_aggregated_gradients, num_groups=num_groups, groups=groups,
            process_set=process_set, scale_local_gradients=scale_local_gradients)
    if not isinstance(optimizer, _LegacyOptimizer):
        raise InvalidArgumentError("Provided optimizer doesn't inherit from either legacy TensorFlow "
                                   f"(tf.compat.v1.train.Optimizer) or Keras optimizer: {optimizer!r}")
    reducer = make_reducer(name or f"Distributed{type(optimizer).__name__}", compression, sparse_as_dense, op,
                           gradient_predivide_factor, num_groups, groups, process_set, scale_local_gradients)
    return _DistributedOptimizer(optimizer, reducer, name, use_locking, backward_passes_per_step,
                                 average_aggregated_gradients)


def broadcast_global_variables(root_rank: int) -> tf.Operation | None:
    """Broadcast ``tf.compat.v1.global_variables()`` from ``root_rank`` (TensorFlow 1-style graphs only).

    Returns:
        The broadcast op (run it in the session).

    Raises:
        RuntimeError: called eagerly (TensorFlow 2 has no global variables: use ``broadcast_variables``).
    """
    if tf.executing_eagerly():
        raise UsageError("hvd.broadcast_global_variables() does not support eager execution. "
                           "Please use `hvd.broadcast_variables(<model/optimizer variables>)` instead.")
    return broadcast_variables(tf.compat.v1.global_variables(), root_rank)


class BroadcastGlobalVariablesHook(tf.compat.v1.train.SessionRunHook):
    """A ``SessionRunHook`` that broadcasts every global variable from ``root_rank`` when the session is
    created (TensorFlow 1-style ``MonitoredTrainingSession`` training).

    Args:
        root_rank: the rank whose values win.
        device: accepted for Horovod compatibility.
    """

    def __init__(self, root_rank: int, device: str = "") -> None:
        super().__init__()
        self.root_rank = root_rank
        self.bcast_op: Any = None
        self.device = device

    def begin(self) -> None:
        """Build the broadcast op in the session's graph."""
        if self.bcast_op is None or self.bcast_op.graph != tf.compat.v1.get_default_graph():
            self.bcast_op = broadcast_global_variables(self.root_rank)

    def after_create_session(self, session: tf.compat.v1.Session, coord: tf.train.Coordinator) -> None:
        """Run the broadcast once the variables are initialized."""
        session.run(self.bcast_op)
