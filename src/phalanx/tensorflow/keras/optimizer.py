"""``DistributedOptimizer`` for Keras: the optimizer's class with an update that averages gradients first.

The update is Keras 3's ``apply`` or Keras 2's (``tf_keras``, new and legacy optimizers) ``apply_gradients``,
for the Keras ``tf.keras`` is (``keras_flavour``).

The wrapper is a subclass of the optimizer's own class made on the fly (as Horovod does), so
``isinstance(opt, keras.optimizers.Adam)`` still holds, saving writes the base class, and a Keras
``LossScaleOptimizer`` wrapped this way averages *before* its overflow check (every rank then sees the same
finite/non-finite verdict; checking local gradients first would let ranks disagree and deadlock).

Gradients are concatenated into one flat buffer per dtype and allreduced with one collective each
(``ops.fused_allreduce``): one call per tensor tripled the per-step overhead in the prototype.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import tensorflow as tf
import torch

from phalanx.errors import InvalidArgumentError
from phalanx.tensorflow import keras_flavour, ops
from phalanx.tensorflow._groups import check_groups, groups_option, local_layer_variables, partition
from phalanx.tensorflow._subclass import mixed_in
from phalanx.tensorflow.compression import Compression, Compressor
from phalanx.torch import frontend
from phalanx.torch.process_sets import ProcessSet, global_process_set

BUFFER_NAME = "DistributedOptimizer.gradients"


@dataclass(frozen=True)
class Options:
    """How a distributed optimizer reduces gradients (fixed at construction)."""

    compression: type[Compressor] = Compression.none
    op: int = frontend.Average
    backward_passes_per_step: int = 1
    average_aggregated_gradients: bool = False
    prescale: float = 1.0
    postscale: float = 1.0
    process_set: ProcessSet = global_process_set
    groups: int | tuple[tuple[Any, ...], ...] = 0  # Horovod's num_groups / groups (0: one fused group)
    scale_local_gradients: bool = True


class _Accumulators:
    """Local gradient sums for ``backward_passes_per_step > 1`` (a plain object: Keras does not track or save it)."""

    def __init__(self, variables: list[Any], key: Any) -> None:
        with tf.init_scope():
            self.sums = {key(v): tf.Variable(tf.zeros(v.shape, dtype=v.dtype), trainable=False) for v in variables}
            self.passes = tf.Variable(0, dtype=tf.int64, trainable=False)


class _DistributedMixin:
    """Averages the gradients across ranks, then applies them as the base class does (both Kerases)."""

    _hvd: Options
    _hvd_acc: _Accumulators | None

    def _hvd_key(self, variable: Any) -> Any:
        return self._var_key(variable)  # type: ignore[attr-defined]

    def _hvd_apply(self, grads: list[Any], variables: list[Any], *args: Any, **kwargs: Any) -> Any:
        """The base optimizer's own update with already reduced gradients."""
        raise NotImplementedError

    def register_local_var(self, var: Any) -> None:
        """Leave ``var``'s gradient out of the reduction (it is applied locally, divided by the set's size
        with ``scale_local_gradients``), as Horovod's ``PartialDistributedOptimizer`` does for local layers."""
        local = self.__dict__.get("_hvd_local")
        if local is None:
            local = set()
            object.__setattr__(self, "_hvd_local", local)
        local.add(self._hvd_key(var))

    def _hvd_reduce(self, grads: list[Any], variables: Any = None) -> list[Any]:
        variables = list(variables if variables is not None else self._trainable_variables)  # type: ignore[attr-defined]
        local = self.__dict__.get("_hvd_local")
        if not local:
            return self._hvd_reduce_shared(grads, variables)
        keys = [self._hvd_key(v) for v in variables]
        shared = [i for i, k in enumerate(keys) if k not in local]
        out = list(grads)
        reduced = self._hvd_reduce_shared([grads[i] for i in shared], [variables[i] for i in shared])
        for i, r in zip(shared, reduced):
            out[i] = r
        if self._hvd.scale_local_gradients:
            n = self._hvd.process_set.size()
            for i, k in enumerate(keys):
                if k in local and out[i] is not None:
                    g = tf.convert_to_tensor(out[i])
                    out[i] = g / tf.cast(n, g.dtype)
        return out

    def _hvd_reduce_shared(self, grads: list[Any], variables: list[Any]) -> list[Any]:
        o = self._hvd
        if not o.groups:
            return ops.fused_allreduce(grads, o.op, o.compression, BUFFER_NAME, o.prescale, o.postscale,
                                       o.process_set)
        keys = [self._hvd_key(v) for v in variables]
        out = list(grads)
        for k, idx in enumerate(partition(keys, o.groups, self._hvd_key)):
            reduced = ops.fused_allreduce([grads[i] for i in idx], o.op, o.compression, f"{BUFFER_NAME}.group{k}",
                                          o.prescale, o.postscale, o.process_set)
            for i, r in zip(idx, reduced):
                out[i] = r
        return out

    def _hvd_accumulate(self, grads: list[Any], variables: list[Any], *args: Any, **kwargs: Any) -> Any:
        """Add this pass's gradients to the local sums; every ``backward_passes_per_step``-th pass, reduce
        and apply the sums. The optimizer's and the sums' variables exist before the branch."""
        keras_flavour.optimizer_variables(self, variables)
        if self._hvd_acc is None:
            object.__setattr__(self, "_hvd_acc", _Accumulators(variables, self._hvd_key))
        acc = self._hvd_acc
        assert acc is not None
        sums = [acc.sums[self._hvd_key(v)] for v in variables]
        for s, g in zip(sums, grads):
            if g is not None:
                s.assign_add(tf.convert_to_tensor(g))
        passes = acc.passes.assign_add(1)
        n = self._hvd.backward_passes_per_step
        scale = 1.0 / n if self._hvd.average_aggregated_gradients else 1.0

        def flush() -> tf.Tensor:
            total = [None if g is None else s.read_value() * tf.cast(scale, s.dtype) for s, g in zip(sums, grads)]
            self._hvd_apply(self._hvd_reduce(total, variables), variables, *args, **kwargs)
            for s in sums:
                s.assign(tf.zeros_like(s))
            return tf.constant(True)

        return tf.cond(passes % n == 0, flush, lambda: tf.constant(False))


class _Keras3Distributed(_DistributedMixin):
    """Keras 3: ``apply`` (which ``apply_gradients`` and ``model.fit`` call) reduces first."""

    def apply(self, grads: Any, trainable_variables: Any = None) -> Any:
        grads = list(grads)
        variables = list(trainable_variables if trainable_variables is not None
                         else self._trainable_variables)  # type: ignore[attr-defined]
        if self._hvd.backward_passes_per_step > 1:
            return self._hvd_accumulate(grads, variables)
        return self._hvd_apply(self._hvd_reduce(grads, variables), variables)

    def _hvd_apply(self, grads: list[Any], variables: list[Any], *args: Any, **kwargs: Any) -> Any:
        return super().apply(grads, variables)  # type: ignore[misc]


class _Keras2Distributed(_DistributedMixin):
    """Keras 2 (``tf_keras``), new and legacy optimizers: ``apply_gradients`` (which ``minimize`` and
    ``model.fit`` call) reduces first. Variables are keyed by ``ref()`` (legacy optimizers have no
    ``_var_key``)."""

    def _hvd_key(self, variable: Any) -> Any:
        return variable.ref()

    def apply_gradients(self, grads_and_vars: Any, *args: Any, **kwargs: Any) -> Any:
        pairs = list(grads_and_vars)
        grads, variables = [g for g, _ in pairs], [v for _, v in pairs]
        if self._hvd.backward_passes_per_step > 1:
            return self._hvd_accumulate(grads, variables, *args, **kwargs)
        return self._hvd_apply(self._hvd_reduce(grads, variables), variables, *args, **kwargs)

    def _hvd_apply(self, grads: list[Any], variables: list[Any], *args: Any, **kwargs: Any) -> Any:
        return super().apply_gradients(zip(grads, variables), *args, **kwargs)  # type: ignore[misc]


_MIXIN: type[_DistributedMixin] = _Keras3Distributed if keras_flavour.is_keras3() else _Keras2Distributed


def distributed_class(base: type) -> Any:
    """The distributed subclass of an optimizer class (cached; same name and module as ``base``)."""
    return mixed_in(_MIXIN, base)


def is_distributed(optimizer: object) -> bool:
    """Whether ``optimizer`` was made by :func:`DistributedOptimizer` (or re-wrapped by ``load_model``)."""
    return isinstance(optimizer, _DistributedMixin)


def options_of(optimizer: Any) -> Options:
    """The reduction options of a distributed optimizer."""
    opts: Options = optimizer._hvd
    return opts


def make_distributed_in_place(optimizer: Any, options: Options) -> Any:
    """Turn an optimizer (with its state, e.g. loaded from a file) into a distributed one; returns it."""
    _check(optimizer, options)
    optimizer.__class__ = distributed_class(type(optimizer))
    object.__setattr__(optimizer, "_hvd", options)
    object.__setattr__(optimizer, "_hvd_acc", None)
    return optimizer


def plain_copy(optimizer: Any) -> Any:
    """A new, non-distributed optimizer of the same base class and configuration."""
    return base_class(optimizer).from_config(optimizer.get_config())


def base_class(optimizer: Any) -> Any:
    """The optimizer's own Keras class (the class a distributed optimizer was made from)."""
    return next(c for c in type(optimizer).__mro__ if not issubclass(c, _DistributedMixin))


def _check(optimizer: Any, options: Options) -> None:
    if not isinstance(optimizer, keras_flavour.optimizer_classes()):
        raise InvalidArgumentError(
            f"DistributedOptimizer needs a {keras_flavour.keras().__name__}.optimizers.Optimizer "
            f"({keras_flavour.version_label()}, the Keras tf.keras is); got "
            f"{type(optimizer).__module__}.{type(optimizer).__name__}")
    n = options.backward_passes_per_step
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise InvalidArgumentError(f"backward_passes_per_step must be an int >= 1; got {n!r}")
    if n > 1 and isinstance(optimizer, keras_flavour.loss_scale_optimizer_class()):
        raise InvalidArgumentError(
            "backward_passes_per_step > 1 with a LossScaleOptimizer (mixed precision) is not supported by "
            "phalanx; use backward_passes_per_step=1 or the inner optimizer's gradient_accumulation_steps")
    frontend.check_op(options.op, torch.float32)
    check_groups(options.groups)


def DistributedOptimizer(
    optimizer: Any, name: str | None = None, device_dense: str = "", device_sparse: str = "",
    compression: type[Compressor] = Compression.none, sparse_as_dense: bool = False,
    gradient_predivide_factor: float = 1.0, op: int = frontend.Average, backward_passes_per_step: int = 1,
    average_aggregated_gradients: bool = False, num_groups: int = 0, groups: Any = None,
    process_set: ProcessSet = global_process_set, scale_local_gradients: bool = True,
) -> Any:
    """Wrap a Keras optimizer so that ``model.fit`` averages gradients across ranks before applying them.

    Args:
        optimizer: an optimizer of the Keras ``tf.keras`` is (a ``LossScaleOptimizer`` too; Keras 2's legacy
            optimizers too).
        name: accepted for Horovod compatibility (the optimizer keeps its own name).
        device_dense: accepted for Horovod compatibility (gradients travel through host memory).
        device_sparse: accepted for Horovod compatibility.
        compression: ``Compression.none`` or ``Compression.fp16`` (the flat buffers travel as float16).
        sparse_as_dense: accepted; sparse (``IndexedSlices``) gradients are always reduced densely.
        gradient_predivide_factor: divide gradients by this before the sum and multiply after (Average).
        op: ``Average`` (default), ``Sum``, ``Min``, ``Max`` or ``Product``.
        backward_passes_per_step: accumulate this many batches locally, then allreduce and apply once.
        average_aggregated_gradients: divide the accumulated gradients by ``backward_passes_per_step``.
        num_groups: Horovod's deprecated spelling of ``groups=<int>``.
        groups: 0 / None (default): every gradient in one fused allreduce per dtype (the fastest measured
            here); an int ``n``: the gradients, in order, in ``n`` groups, each fused and reduced separately;
            lists of variables: each list one group, every other variable a group of its own.
        process_set: the ranks that average their gradients.
        scale_local_gradients: divide the gradients of local variables (``register_local_var``) by the
            set's size.

    Returns:
        A new optimizer of the same class and configuration whose ``apply`` reduces gradients first.

    Raises:
        InvalidArgumentError: not an optimizer of that Keras, a bad ``backward_passes_per_step``, op or groups.
    """
    if gradient_predivide_factor <= 0:
        raise InvalidArgumentError(f"gradient_predivide_factor must be > 0; got {gradient_predivide_factor!r}")
    options = Options(compression=compression, op=op, backward_passes_per_step=backward_passes_per_step,
                      average_aggregated_gradients=average_aggregated_gradients,
                      prescale=1.0 / gradient_predivide_factor, postscale=gradient_predivide_factor,
                      process_set=process_set, groups=groups_option(num_groups, groups),
                      scale_local_gradients=scale_local_gradients)
    return with_options(optimizer, options)


def with_options(optimizer: Any, options: Options) -> Any:
    """A new distributed optimizer wrapping ``optimizer`` with the given options."""
    _check(optimizer, options)
    new = distributed_class(type(optimizer)).from_config(optimizer.get_config())
    object.__setattr__(new, "_hvd", options)
    object.__setattr__(new, "_hvd_acc", None)
    return new


def PartialDistributedOptimizer(
    optimizer: Any, name: str | None = None, device_dense: str = "", device_sparse: str = "",
    compression: type[Compressor] = Compression.none, sparse_as_dense: bool = False,
    gradient_predivide_factor: float = 1.0, op: int = frontend.Average, backward_passes_per_step: int = 1,
    average_aggregated_gradients: bool = False, groups: Any = None, process_set: ProcessSet = global_process_set,
    scale_local_gradients: bool = True, local_layers: Any = None,
) -> Any:
    """:func:`DistributedOptimizer` that leaves the gradients of ``local_layers``' weights local.

    Args:
        local_layers: a Keras layer or layers whose trainable weights stay per rank (not reduced); their
            gradients are divided by the set's size with ``scale_local_gradients``, as in Horovod.
        (the others as in :func:`DistributedOptimizer`)

    Raises:
        InvalidArgumentError: an entry of ``local_layers`` is not a Keras layer.
    """
    opt = DistributedOptimizer(optimizer, name, device_dense, device_sparse, compression, sparse_as_dense,
                               gradient_predivide_factor, op, backward_passes_per_step, average_aggregated_gradients,
                               0, groups, process_set, scale_local_gradients)
    for variable in local_layer_variables(local_layers):
        opt.register_local_var(variable)
    return opt
