"""Allreduce on TensorFlow tensors (Horovod's ``horovod.tensorflow`` names), eager or inside ``tf.function``.

Every op runs on ``phalanx.torch``'s collectives (see ``_bridge``): the same order rule and the same
cross-rank signature check, so ranks that disagree get ``CollectiveMismatchError`` instead of a hang. The
public ops are differentiable with Horovod's gradients (an allreduce's gradient is the allreduce of the
incoming gradient with the same op and factors); ``fused_allreduce``, the optimizers' path, is not.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import tensorflow as tf

from phalanx.tensorflow import _dlpack
from phalanx.tensorflow.collectives import allgather, broadcast_variables, scoped_name
from phalanx.tensorflow.compression import Compression, Compressor
from phalanx.tensorflow.tf_types import Gradient
from phalanx.torch import frontend as reduce_ops
from phalanx.torch.process_sets import ProcessSet, global_process_set

#: Defined in collectives.py (which ops.py builds on); importable from here as in Horovod's layout.
__all__ = ["allreduce", "broadcast_variables", "fused_allreduce", "grouped_allreduce", "scoped_name"]


def _grad_name(name: str | None) -> str | None:
    return f"{name}.grad" if name else None


def _check_sparse(op: int, prescale_factor: float, postscale_factor: float) -> None:
    if op == reduce_ops.Adasum:
        raise NotImplementedError("The Adasum reduction does not support sparse tensors; pass "
                                  "sparse_as_dense=True to DistributedOptimizer")
    if op not in (reduce_ops.Sum, reduce_ops.Average):
        raise NotImplementedError("Only Sum and Average ops are supported with tf.IndexedSlices")
    if prescale_factor != 1.0 or postscale_factor != 1.0:
        raise NotImplementedError("Pre/postscale_factor are not supported with tf.IndexedSlices")


def _sparse_allreduce(slices: tf.IndexedSlices, op: int, name: str | None,
                      process_set: ProcessSet) -> tf.IndexedSlices:
    """Horovod's reduction of ``IndexedSlices``: allgather the values and the indices (duplicates stay,
    as TensorFlow's own sparse updates sum them); ``Average`` divides the values by the set's size."""
    values = allgather(slices.values, name=f"{name}.values" if name else None, process_set=process_set)
    indices = allgather(slices.indices, name=f"{name}.indices" if name else None, process_set=process_set)
    if op == reduce_ops.Average:
        values = values / tf.cast(process_set.size(), values.dtype)
    return tf.IndexedSlices(values, indices, dense_shape=slices.dense_shape)


def _dense_allreduce(tensor: tf.Tensor, name: str | None, op: int, pre: float, post: float,
                     process_set: ProcessSet) -> tf.Tensor:
    @tf.custom_gradient
    def reduce(x: tf.Tensor) -> tuple[tf.Tensor, Callable[[tf.Tensor], tf.Tensor]]:
        def grad(dy: tf.Tensor) -> tf.Tensor:
            return _dlpack.tf_allreduce(tf.convert_to_tensor(dy), _grad_name(name), op, pre, post, process_set)

        return _dlpack.tf_allreduce(x, name, op, pre, post, process_set), grad

    return reduce(tensor)


def allreduce(
    tensor: object, average: bool | None = None, device_dense: str = "", device_sparse: str = "",
    compression: type[Compressor] = Compression.none, op: int | None = None, prescale_factor: float = 1.0,
    postscale_factor: float = 1.0, name: str | None = None, process_set: ProcessSet = global_process_set,
    ignore_name_scope: bool = False,
) -> tf.Tensor | tf.IndexedSlices:
    """Allreduce a tensor across the set (``hvd.allreduce``); eager or in a graph; differentiable.

    Args:
        tensor: a ``tf.Tensor``, variable, ``tf.IndexedSlices`` or array-like.
        average: deprecated; True means ``op=Average``, False ``op=Sum``.
        device_dense: accepted for Horovod compatibility (tensors travel through host memory).
        device_sparse: accepted for Horovod compatibility.
        compression: ``Compression.none`` or ``Compression.fp16`` (dense tensors).
        op: ``Average`` (default), ``Sum``, ``Min``, ``Max`` or ``Product``; ``IndexedSlices`` take
            ``Sum`` or ``Average`` only.
        prescale_factor: multiply inputs by this before reducing.
        postscale_factor: multiply the result by this.
        name: optional name, shown in errors.
        process_set: the ranks taking part.
        ignore_name_scope: do not prefix ``name`` with the enclosing ``tf.name_scope`` in a graph.

    Returns:
        The reduced tensor (same dtype and shape); for ``IndexedSlices``, ``IndexedSlices`` holding every
        rank's values and indices (Horovod's allgather-based sparse allreduce).

    Raises:
        ValueError: before ``hvd.init()`` or on a bad op.
        NotImplementedError: ``IndexedSlices`` with another op or with scale factors (as in Horovod).
        CollectiveMismatchError: ranks disagree on shape, dtype, op, ... (on every rank).
    """
    op_ = reduce_ops.resolve_op(op, average)
    name = scoped_name(name, ignore_name_scope)
    if isinstance(tensor, tf.IndexedSlices):
        _check_sparse(op_, prescale_factor, postscale_factor)
        return _sparse_allreduce(tensor, op_, name, process_set)
    compressed, ctx = compression.compress(tf.convert_to_tensor(tensor))
    out = _dense_allreduce(compressed, name, op_, prescale_factor, postscale_factor, process_set)
    return compression.decompress(out, ctx)


def grouped_allreduce(
    tensors: Sequence[object], average: bool | None = None, device_dense: str = "", device_sparse: str = "",
    compression: type[Compressor] = Compression.none, op: int | None = None, prescale_factor: float = 1.0,
    postscale_factor: float = 1.0, process_set: ProcessSet = global_process_set, ignore_name_scope: bool = False,
    name: str | None = None,
) -> list[Gradient]:
    """Allreduce several tensors as one flat buffer per dtype (one collective per dtype); differentiable.

    ``IndexedSlices`` among them are reduced as :func:`allreduce` reduces them; None stays None.

    Returns:
        The reduced tensors, in order.
    """
    tensors = list(tensors)
    if not tensors:
        return []
    op_ = reduce_ops.resolve_op(op, average)
    name = scoped_name(name, ignore_name_scope) or "grouped_allreduce"
    out: list[Gradient] = [None] * len(tensors)
    dense = []
    for i, t in enumerate(tensors):
        if isinstance(t, tf.IndexedSlices):
            _check_sparse(op_, prescale_factor, postscale_factor)
            out[i] = _sparse_allreduce(t, op_, f"{name}.{i}", process_set)
        elif t is not None:
            dense.append(i)
    if dense:
        packed = [compression.compress(tf.convert_to_tensor(tensors[i])) for i in dense]
        reduced = _differentiable_fused([p[0] for p in packed], op_, name, prescale_factor, postscale_factor,
                                        process_set)
        for i, r, (_, ctx) in zip(dense, reduced, packed):
            out[i] = compression.decompress(r, ctx)
    return out


def _differentiable_fused(tensors: list[tf.Tensor], op: int, name: str, pre: float, post: float,
                          process_set: ProcessSet) -> list[tf.Tensor]:
    @tf.custom_gradient
    def reduce(*xs: tf.Tensor) -> tuple[list[tf.Tensor], Callable[..., list[tf.Tensor]]]:
        def grad(*dys: tf.Tensor) -> list[tf.Tensor]:
            return _dlpack.tf_fused_allreduce([tf.convert_to_tensor(d) for d in dys], f"{name}.grad", op, pre, post,
                                              process_set)

        return _dlpack.tf_fused_allreduce(list(xs), name, op, pre, post, process_set), grad

    return list(reduce(*tensors))


def fused_allreduce(
    tensors: list[Gradient], op: int, compression: type[Compressor], name: str, pre: float = 1.0, post: float = 1.0,
    process_set: ProcessSet = global_process_set,
) -> list[tf.Tensor | None]:
    """The fusion behind the distributed optimizers and tapes: one ``tf.numpy_function`` call, one
    collective per dtype; not differentiable (it reduces gradients, which nothing differentiates again).

    Compression applies to each tensor (in TF); the concatenation into one buffer per dtype, the reduction
    and the split happen in numpy/torch inside the call (TF's own concat + split cost more than the
    allreduce of a 1.2M-parameter CNN on this machine).

    Args:
        tensors: tensors (None entries are passed through; ``IndexedSlices`` are reduced densely).
        op: the reduce op code.
        compression: applied to each tensor before the fusion.
        name: the prefix of each buffer's collective name (``name.float32``; a compressed float32 buffer
            travels as ``name.float16``).
        pre: prescale factor.
        post: postscale factor.
        process_set: the ranks taking part.

    Returns:
        The reduced tensors in the input order.
    """
    present = [i for i, t in enumerate(tensors) if t is not None]
    out: list[tf.Tensor | None] = [None] * len(tensors)
    if not present:
        return out
    packed = [compression.compress(tf.convert_to_tensor(tensors[i])) for i in present]
    reduced = _dlpack.tf_fused_allreduce([p[0] for p in packed], name, op, pre, post, process_set)
    for i, r, (_, ctx) in zip(present, reduced, packed):
        out[i] = compression.decompress(r, ctx)
    return out
