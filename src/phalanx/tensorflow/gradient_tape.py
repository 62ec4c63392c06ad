"""``DistributedGradientTape`` and ``PartialDistributedGradientTape``: a TF2 custom loop's gradients,
averaged across ranks (Horovod's names and parameters).

Wrap the tape after recording; ``tape.gradient`` then returns reduced gradients::

    with tf.GradientTape() as tape:
        loss = loss_fn(model(x), y)
    tape = hvd.DistributedGradientTape(tape)
    grads = tape.gradient(loss, model.trainable_variables)
"""

from __future__ import annotations

from typing import Any

import tensorflow as tf

from phalanx.errors import InvalidArgumentError
from phalanx.tensorflow._groups import GroupsOption, LocalLayers, local_layer_variables
from phalanx.tensorflow._reduce_grads import GradReducer, make_reducer
from phalanx.tensorflow._subclass import mixed_in
from phalanx.tensorflow.compression import Compression, Compressor
from phalanx.tensorflow.tf_types import Gradient
from phalanx.torch import frontend as reduce_ops
from phalanx.torch.process_sets import ProcessSet, global_process_set


class _DistributedGradientTapeMixin:
    """Overrides ``gradient``: reduce the gradients of the non-local sources across the set."""

    _hvd_reducer: GradReducer

    def register_local_source(self, source: object) -> None:
        """Leave ``source``'s gradient local (not reduced; divided by the set's size with
        ``scale_local_gradients``)."""
        self._hvd_reducer.register_local(source)

    def gradient(self, target: object, sources: object, output_gradients: object = None,
                 unconnected_gradients: tf.UnconnectedGradients = tf.UnconnectedGradients.NONE,
                 use_generic_names: bool = False) -> object:
        del use_generic_names  # Horovod's collective names; phalanx names the fused buffers itself
        grads = super().gradient(target, sources, output_gradients,  # type: ignore[misc]
                                 unconnected_gradients=unconnected_gradients)
        flat_sources = tf.nest.flatten(sources)
        flat = self._hvd_reducer(tf.nest.flatten(grads), flat_sources)
        return tf.nest.pack_sequence_as(grads, flat)

    def get_local_and_global_gradients(self, target: object, sources: object, output_gradients: object = None,
                                       ) -> tuple[list[tuple[object, Gradient]], list[tuple[object, Gradient]]]:
        """:meth:`gradient`'s results split into ``(local, global)`` lists of ``(variable, gradient)`` pairs,
        in the order of ``sources``: the local sources' gradients (not reduced; divided by the set's size
        with ``scale_local_gradients``) and the reduced ones."""
        flat_sources = tf.nest.flatten(sources)
        grads = tf.nest.flatten(self.gradient(target, sources, output_gradients))
        local: list[tuple[object, Gradient]] = []
        shared: list[tuple[object, Gradient]] = []
        for source, grad in zip(flat_sources, grads):
            (local if self._hvd_reducer.is_local(source) else shared).append((source, grad))
        return local, shared


def DistributedGradientTape(
    gradtape: tf.GradientTape, device_dense: str = "", device_sparse: str = "",
    compression: type[Compressor] = Compression.none, sparse_as_dense: bool = False, op: int = reduce_ops.Average,
    gradient_predivide_factor: float = 1.0, num_groups: int = 0, groups: GroupsOption = None,
    process_set: ProcessSet = global_process_set, scale_local_gradients: bool = True,
) -> tf.GradientTape:
    """A tape whose ``gradient`` averages (``op``) the gradients across the set's ranks.

    Args:
        gradtape: the ``tf.GradientTape`` that recorded the forward pass (its recording is kept).
        device_dense: accepted for Horovod compatibility (gradients travel through host memory).
        device_sparse: accepted for Horovod compatibility.
        compression: ``Compression.none`` or ``Compression.fp16``.
        sparse_as_dense: reduce ``IndexedSlices`` densely (else by allgather, as Horovod does).
        op: ``Average`` (default), ``Sum``, ``Min``, ``Max`` or ``Product`` (``Adasum``: NotImplementedError).
        gradient_predivide_factor: with ``Average``, divide by this before the sum and multiply after.
        num_groups: Horovod's deprecated spelling of ``groups=<int>``.
        groups: None / 0: one fused reduction per dtype; an int: that many groups in order; lists of
            variables: each list one group, every other variable a group of its own.
        process_set: the ranks that reduce their gradients (others get their local gradients back).
        scale_local_gradients: divide the gradients of local sources by the set's size.

    Returns:
        A tape of the same class as ``gradtape`` (``isinstance`` holds), with ``register_local_source``.

    Raises:
        InvalidArgumentError: a bad ``gradient_predivide_factor`` or ``groups``, or not a ``tf.GradientTape``.
    """
    del device_dense, device_sparse
    if not isinstance(gradtape, tf.GradientTape):
        raise InvalidArgumentError(f"DistributedGradientTape needs a tf.GradientTape; got {type(gradtape).__name__}")
    reducer = make_reducer("DistributedGradientTape", compression, sparse_as_dense, op, gradient_predivide_factor,
                           num_groups, groups, process_set, scale_local_gradients)
    tape: Any = object.__new__(mixed_in(_DistributedGradientTapeMixin, type(gradtape)))
    tape.__dict__.update(gradtape.__dict__)  # the recording itself (``_tape``) is shared, not copied
    tape._hvd_reducer = reducer
    return tape


def PartialDistributedGradientTape(
    gradtape: tf.GradientTape, device_dense: str = "", device_sparse: str = "",
    compression: type[Compressor] = Compression.none, sparse_as_dense: bool = False, op: int = reduce_ops.Average,
    gradient_predivide_factor: float = 1.0, num_groups: int = 0, groups: GroupsOption = None,
    process_set: ProcessSet = global_process_set, local_layers: LocalLayers = None,
    scale_local_gradients: bool = True,
) -> tf.GradientTape:
    """:func:`DistributedGradientTape` that leaves the gradients of ``local_layers``' weights local.

    Args:
        local_layers: a Keras layer or layers whose trainable weights stay per rank (not reduced).
        (the others as in :func:`DistributedGradientTape`)

    Raises:
        InvalidArgumentError: an entry of ``local_layers`` is not a Keras layer.
    """
    tape = DistributedGradientTape(gradtape, device_dense, device_sparse, compression, sparse_as_dense, op,
                                   gradient_predivide_factor, num_groups, groups, process_set, scale_local_gradients)
    for variable in local_layer_variables(local_layers):
        tape.register_local_source(variable)
    return tape
