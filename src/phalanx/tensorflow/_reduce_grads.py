"""How the TensorFlow-level tapes and optimizers reduce a list of gradients (Horovod's ``allreduce_grads``).

Dense gradients go through one fused ``tf.numpy_function`` call per group (one collective per dtype);
``IndexedSlices`` are reduced densely with ``sparse_as_dense``, else by Horovod's allgather of values and
indices. Gradients of variables registered as local are left out of the reduction and, with
``scale_local_gradients``, divided by the set's size (Horovod's rule for partially distributed training).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import dataclass, field

import tensorflow as tf

from phalanx.errors import InvalidArgumentError
from phalanx.tensorflow import ops
from phalanx.tensorflow._groups import Groups, GroupsOption, check_groups, groups_option, partition
from phalanx.tensorflow.compression import Compression, Compressor
from phalanx.tensorflow.tf_types import Gradient
from phalanx.torch import frontend as reduce_ops
from phalanx.torch.process_sets import ProcessSet, global_process_set


def var_key(variable: object) -> Hashable:
    """A hashable identity of a variable (``ref()`` for TensorFlow variables, the object otherwise)."""
    return variable.ref() if hasattr(variable, "ref") else id(variable)


@dataclass
class GradReducer:
    """The reduction options of a distributed tape or optimizer, and its set of local variables."""

    name: str
    compression: type[Compressor] = Compression.none
    sparse_as_dense: bool = False
    op: int = reduce_ops.Average
    prescale: float = 1.0
    postscale: float = 1.0
    groups: Groups = 0
    process_set: ProcessSet = global_process_set
    scale_local_gradients: bool = True
    local: set[Hashable] = field(default_factory=set)

    def register_local(self, variable: object) -> None:
        """Keep ``variable``'s gradient out of the reduction from now on."""
        self.local.add(var_key(variable))

    def is_local(self, variable: object) -> bool:
        """Whether ``variable`` was registered as local."""
        return var_key(variable) in self.local

    def __call__(self, grads: list[Gradient], variables: list[object]) -> list[Gradient]:
        """The reduced gradients, in order (None stays None)."""
        if not self.process_set.included():
            return list(grads)
        out = list(grads)
        shared = [i for i, v in enumerate(variables) if not self.is_local(v)]
        for idx in self._groups([variables[i] for i in shared]):
            chosen = [shared[i] for i in idx]
            for i, r in zip(chosen, self._reduce([grads[i] for i in chosen], len(out))):
                out[i] = r
        if self.scale_local_gradients and self.local:
            self._scale_local(out, variables)
        return out

    def _groups(self, variables: list[object]) -> list[list[int]]:
        if not self.groups:
            return [list(range(len(variables)))]
        return partition([var_key(v) for v in variables], self.groups, var_key)

    def _reduce(self, grads: list[Gradient], tag: int) -> list[Gradient]:
        out = list(grads)
        dense: list[int] = []
        for i, g in enumerate(grads):
            if isinstance(g, tf.IndexedSlices) and not self.sparse_as_dense:
                out[i] = ops.allreduce(g, op=self.op, name=f"{self.name}.sparse{i}", process_set=self.process_set)
            elif g is not None:
                dense.append(i)
        reduced = ops.fused_allreduce([grads[i] for i in dense], self.op, self.compression,
                                      f"{self.name}.gradients", self.prescale, self.postscale, self.process_set)
        for i, r in zip(dense, reduced):
            out[i] = r
        return out

    def _scale_local(self, out: list[Gradient], variables: list[object]) -> None:
        n = self.process_set.size()
        for i, v in enumerate(variables):
            g = out[i]
            if not self.is_local(v) or g is None:
                continue
            if isinstance(g, tf.IndexedSlices):
                out[i] = tf.IndexedSlices(g.values / n, g.indices, g.dense_shape)
            else:
                out[i] = g / tf.cast(n, g.dtype)


def make_reducer(name: str, compression: type[Compressor], sparse_as_dense: bool, op: int,
                 gradient_predivide_factor: float, num_groups: int, groups: GroupsOption, process_set: ProcessSet,
                 scale_local_gradients: bool) -> GradReducer:
    """Validate Horovod's options (its errors, as ``InvalidArgumentError``, a ``ValueError``) and build the
    reducer; ``Average`` with ``gradient_predivide_factor`` f scales by 1/f before the sum and f after."""
    if gradient_predivide_factor != 1.0 and op != reduce_ops.Average:
        raise InvalidArgumentError("gradient_predivide_factor not supported with op != Average")
    if gradient_predivide_factor <= 0:
        raise InvalidArgumentError(f"gradient_predivide_factor must be > 0; got {gradient_predivide_factor!r}")
    if op == reduce_ops.Adasum:
        raise NotImplementedError("phalanx does not implement Adasum; use op=hvd.Average")
    chosen = groups_option(num_groups, groups)
    check_groups(chosen)
    pre, post = (1.0 / gradient_predivide_factor, gradient_predivide_factor) if op == reduce_ops.Average else (1, 1)
    return GradReducer(name, compression, sparse_as_dense, op, pre, post, chosen, process_set, scale_local_gradients)


ReduceFn = Callable[[list[Gradient], list[object]], list[Gradient]]
