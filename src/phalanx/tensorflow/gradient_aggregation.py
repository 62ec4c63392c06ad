"""``LocalGradientAggregationHelper``: sum gradients locally over N backward passes, reduce and apply once.

Horovod's helper behind ``backward_passes_per_step`` for the legacy (``tf.compat.v1.train``) optimizers: every
rank counts the same passes, so the ranks meet in the reduction on the same pass.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable

import tensorflow as tf

from phalanx.errors import InvalidArgumentError
from phalanx.tensorflow._reduce_grads import ReduceFn, var_key
from phalanx.tensorflow.tf_types import Gradient
from phalanx.torch.process_sets import ProcessSet, global_process_set


class LocalGradientAggregationHelper:
    """Accumulates gradients for ``backward_passes_per_step`` passes, then reduces them with ``allreduce_func``.

    Args:
        backward_passes_per_step: passes summed locally before one reduction (>= 1).
        allreduce_func: ``(grads, vars) -> reduced grads``.
        sparse_as_dense: turn ``IndexedSlices`` into dense tensors before summing them.
        average_aggregated_gradients: divide the sum by ``backward_passes_per_step``.
        rank: this process's rank (kept for Horovod compatibility).
        optimizer_type: ``_OPTIMIZER_TYPE_LEGACY`` or ``_OPTIMIZER_TYPE_KERAS``.
        process_set: the ranks taking part.
        scale_local_gradients: divide the gradients of local variables by the set's size.
        name: prefix of the accumulator variables.
    """

    _OPTIMIZER_TYPE_KERAS = "optimizer_type_keras"
    _OPTIMIZER_TYPE_LEGACY = "optimizer_type_legacy"

    def __init__(self, backward_passes_per_step: int, allreduce_func: ReduceFn,
                 sparse_as_dense: bool, average_aggregated_gradients: bool, rank: int, optimizer_type: str,
                 process_set: ProcessSet = global_process_set, scale_local_gradients: bool = True,
                 name: str | None = None) -> None:
        if isinstance(backward_passes_per_step, bool) or backward_passes_per_step < 1:
            raise InvalidArgumentError(
                f"backward_passes_per_step must be an int >= 1; got {backward_passes_per_step!r}")
        self.backward_passes_per_step = backward_passes_per_step
        self.allreduce_grads = allreduce_func
        self.sparse_as_dense = sparse_as_dense
        self.average_aggregated_gradients = average_aggregated_gradients
        self.rank = rank
        self.optimizer_type = optimizer_type
        self.process_set = process_set
        self.scale_local_gradients = scale_local_gradients
        self.name = name or "LocalGradientAggregationHelper"
        self.counter: tf.Variable | None = None
        self.locally_aggregated_grads: dict[Hashable, tf.Variable] = {}
        self._local_vars: set[Hashable] = set()
        self.at_boundary = tf.constant(False)

    def register_local_var(self, var: object) -> None:
        """Keep ``var``'s gradient out of the reduction (it is applied locally)."""
        self._local_vars.add(var_key(var))

    def _accumulators(self, grads: list[Gradient], variables: list[tf.Variable]) -> list[tf.Variable | None]:
        with tf.init_scope():
            if self.counter is None:
                self.counter = tf.Variable(0, dtype=tf.int64, trainable=False, name=f"{self.name}_counter")
            for g, v in zip(grads, variables):
                if g is not None and var_key(v) not in self.locally_aggregated_grads:
                    self.locally_aggregated_grads[var_key(v)] = tf.Variable(
                        tf.zeros(v.shape, dtype=v.dtype), trainable=False, name=f"{self.name}_aggregated")
        return [None if g is None else self.locally_aggregated_grads[var_key(v)] for g, v in zip(grads, variables)]

    def compute_gradients(self, grads: Iterable[Gradient], vars: Iterable[tf.Variable]) -> list[Gradient]:
        """Add this pass's gradients to the sums; on the last pass of a step return the reduced sums (the
        local gradients otherwise, which :meth:`apply_gradients` then does not apply)."""
        grads, variables = list(grads), list(vars)
        if self.sparse_as_dense:
            grads = [tf.convert_to_tensor(g) if isinstance(g, tf.IndexedSlices) else g for g in grads]
        sums = self._accumulators(grads, variables)
        for s, g in zip(sums, grads):
            if s is not None:
                s.assign_add(tf.convert_to_tensor(g))
        assert self.counter is not None
        passes = self.counter.assign_add(1)
        self.at_boundary = tf.equal(passes % self.backward_passes_per_step, 0)
        scale = 1.0 / self.backward_passes_per_step if self.average_aggregated_gradients else 1.0

        def reduced() -> list[tf.Tensor]:
            total = [None if s is None else s.read_value() * tf.cast(scale, s.dtype) for s in sums]
            out = self.allreduce_grads(total, variables)
            for s in sums:
                if s is not None:
                    s.assign(tf.zeros_like(s))
            return [tf.zeros_like(v) if o is None else tf.convert_to_tensor(o) for o, v in zip(out, variables)]

        def local() -> list[tf.Tensor]:
            return [tf.zeros_like(v) if g is None else tf.convert_to_tensor(g) for g, v in zip(grads, variables)]

        result = tf.cond(self.at_boundary, reduced, local)
        return [None if g is None else r for g, r in zip(grads, result)]

    def apply_gradients(self, apply_grads_closure: Callable[[], object], optimizer: object, *args: object,
                        **kwargs: object) -> tf.Tensor:
        """Run ``apply_grads_closure`` on the last pass of each step only; a no-op on the others."""
        del optimizer, args, kwargs

        def apply() -> tf.Tensor:
            apply_grads_closure()
            return tf.constant(True)

        return tf.cond(self.at_boundary, apply, lambda: tf.constant(False))
