"""Allgather, broadcast, alltoall and reducescatter on TensorFlow tensors (Horovod's names and signatures).

Eager or inside ``tf.function`` (through ``tf.numpy_function``). Each op is differentiable with the gradient
Horovod registers for it: an allgather's is the averaged gradient's slice of this rank; a broadcast's the
averaged gradient on the root and zeros elsewhere; an alltoall's the alltoall of the gradient back with the
received splits; a reducescatter's the allgather of the gradient (times the set's size for ``Sum``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import tensorflow as tf

from phalanx.tensorflow import _bridge, _dlpack
from phalanx.tensorflow.compression import Compression, Compressor
from phalanx.tensorflow.tf_types import VariableLike
from phalanx.torch import frontend as reduce_ops
from phalanx.torch.process_sets import ProcessSet, global_process_set


def scoped_name(name: str | None, ignore_name_scope: bool) -> str | None:
    """Horovod's collective name: prefixed with the enclosing ``tf.name_scope`` while building a graph,
    unless ``ignore_name_scope`` (every rank builds the same graph, so the names still agree)."""
    if name is None or ignore_name_scope or tf.executing_eagerly():
        return name
    scope = tf.get_current_name_scope()
    return f"{scope}/{name}" if scope else name


def _grad_name(name: str | None, what: str = "grad") -> str | None:
    return f"{name}.{what}" if name else None


def _own_slice(dy: tf.Tensor, x: tf.Tensor, name: str | None, process_set: ProcessSet) -> tf.Tensor:
    """This member's rows of an allgather's gradient (averaged over the set first, as Horovod does)."""
    averaged = _dlpack.tf_allreduce(tf.convert_to_tensor(dy), _grad_name(name), reduce_ops.Average, 1.0, 1.0,
                                    process_set)
    rows = tf.reshape(tf.shape(x, out_type=tf.int64)[0], [1])
    sizes = tf.reshape(_dlpack.tf_allgather(rows, _grad_name(name, "rows"), process_set), [process_set.size()])
    start = tf.reduce_sum(sizes[: process_set.rank()])
    return averaged[start : start + sizes[process_set.rank()]]


def allgather(tensor: object, name: str | None = None, ignore_name_scope: bool = False,
              process_set: ProcessSet = global_process_set) -> tf.Tensor:
    """Concatenate every member's tensor along dim 0 (dim 0 may differ between ranks), in rank order."""
    name = scoped_name(name, ignore_name_scope)

    @tf.custom_gradient
    def gather(x: tf.Tensor) -> tuple[tf.Tensor, Callable[[tf.Tensor], tf.Tensor]]:
        return _dlpack.tf_allgather(x, name, process_set), lambda dy: _own_slice(dy, x, name, process_set)

    return gather(tf.convert_to_tensor(tensor))


def grouped_allgather(tensors: Sequence[object], name: str | None = None, ignore_name_scope: bool = False,
                      process_set: ProcessSet = global_process_set) -> list[tf.Tensor]:
    """Allgather each tensor along dim 0 as one grouped collective; returns the gathered tensors in order."""
    converted = [tf.convert_to_tensor(t) for t in tensors]
    if not converted:
        return []
    name = scoped_name(name, ignore_name_scope)

    @tf.custom_gradient
    def gather(*xs: tf.Tensor) -> tuple[list[tf.Tensor], Callable[..., list[tf.Tensor]]]:
        def grad(*dys: tf.Tensor) -> list[tf.Tensor]:
            return [_own_slice(dy, x, _grad_name(name, str(i)), process_set) for i, (dy, x) in enumerate(zip(dys, xs))]

        def fn(op_name: str | None, *arrays: np.ndarray) -> list[np.ndarray]:
            return _bridge.np_grouped_allgather(list(arrays), op_name, process_set)

        outs = _bridge.graph_call(fn, list(xs), [x.dtype for x in xs], "phalanx_grouped_allgather", name)
        for out, x in zip(outs, xs):
            out.set_shape(tf.TensorShape([None]).concatenate(x.shape[1:]))
        return list(outs), grad

    return list(gather(*converted))


def broadcast(tensor: object, root_rank: int, name: str | None = None, ignore_name_scope: bool = False,
              process_set: ProcessSet = global_process_set) -> tf.Tensor:
    """Return ``root_rank``'s tensor (a global rank) on every member of the set."""
    name = scoped_name(name, ignore_name_scope)

    @tf.custom_gradient
    def bcast(x: tf.Tensor) -> tuple[tf.Tensor, Callable[[tf.Tensor], tf.Tensor]]:
        def grad(dy: tf.Tensor) -> tf.Tensor:
            averaged = _dlpack.tf_allreduce(tf.convert_to_tensor(dy), _grad_name(name), reduce_ops.Average, 1.0,
                                            1.0, process_set)
            return averaged if _global_rank() == root_rank else averaged * 0

        return _dlpack.tf_broadcast(x, root_rank, name, process_set), grad

    return bcast(tf.convert_to_tensor(tensor))


def _global_rank() -> int:
    import phalanx.torch as ptorch

    return ptorch.rank()


def broadcast_(variables: Sequence[VariableLike], root_rank: int, name: str | None = None,
               process_set: ProcessSet = global_process_set) -> list[tf.Tensor]:
    """Broadcast ``variables`` in place from ``root_rank``; returns their new values (Horovod's
    ``broadcast_``). Every member passes the same variables (count, shapes, dtypes) in the same order."""
    variables = list(variables)
    if not tf.executing_eagerly():  # each value read after its assignment: running it runs the broadcast
        return [tf.convert_to_tensor(a) for a in _graph_assigns(variables, root_rank, name or "broadcast_",
                                                                process_set)]
    broadcast_variables(variables, root_rank, process_set, name=name or "broadcast_")
    return [tf.convert_to_tensor(v) for v in variables]


def alltoall(tensor: object, splits: object = None, name: str | None = None, ignore_name_scope: bool = False,
             process_set: ProcessSet = global_process_set) -> tf.Tensor | tuple[tf.Tensor, tf.Tensor]:
    """Send ``splits[i]`` rows (dim 0) to the i-th member and gather what every member sent here.

    Args:
        tensor: the rows to scatter.
        splits: rows per member, in rank order; None splits dim 0 equally (it must divide by the size).
        name: optional name, shown in errors.
        ignore_name_scope: do not prefix ``name`` with the enclosing ``tf.name_scope`` in a graph.
        process_set: the ranks taking part.

    Returns:
        The received rows when ``splits`` is None; else ``(received rows, received splits)``, as in Horovod.
    """
    name = scoped_name(name, ignore_name_scope)
    x = tf.convert_to_tensor(tensor)
    given = splits is not None
    split_tensor = tf.cast(tf.convert_to_tensor(splits), tf.int32) if given else tf.constant([], tf.int32)
    out, received = _alltoall(x, split_tensor, name, process_set)
    return (out, received) if given else out


def _alltoall(x: tf.Tensor, splits: tf.Tensor, name: str | None, process_set: ProcessSet,
              ) -> tuple[tf.Tensor, tf.Tensor]:
    def fn(op_name: str | None, array: np.ndarray, counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        return _bridge.np_alltoall(array, counts, op_name, process_set)

    @tf.custom_gradient
    def exchange(x: tf.Tensor) -> tuple[tuple[tf.Tensor, tf.Tensor], Callable[..., tf.Tensor]]:
        out, received = _bridge.graph_call(fn, [x, splits], [x.dtype, tf.int32], "phalanx_alltoall", name)
        out.set_shape(tf.TensorShape([None]).concatenate(x.shape[1:]))
        received.set_shape([process_set.size()])

        def grad(dy: tf.Tensor, _unused: object = None) -> tf.Tensor:
            back, _ = _alltoall(tf.convert_to_tensor(dy), received, _grad_name(name), process_set)
            return back

        return (out, received), grad

    return exchange(x)


def reducescatter(
    tensor: object, device_dense: str = "", compression: type[Compressor] = Compression.none,
    op: int = reduce_ops.Average, name: str | None = None, process_set: ProcessSet = global_process_set,
    ignore_name_scope: bool = False, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
) -> tf.Tensor:
    """Reduce ``tensor`` across the set and keep this member's block of dim 0 (``hvd.reducescatter``).

    Args:
        tensor: the same shape and dtype on every member.
        device_dense: accepted for Horovod compatibility (tensors travel through host memory).
        compression: ``Compression.none`` or ``Compression.fp16``.
        op: ``Average`` (default) or ``Sum`` (also ``Min``, ``Max``, ``Product``).
        name: optional name, shown in errors.
        process_set: the ranks taking part.
        ignore_name_scope: do not prefix ``name`` with the enclosing ``tf.name_scope`` in a graph.
        prescale_factor: multiply inputs by this before reducing.
        postscale_factor: multiply the result by this.

    Returns:
        This member's rows of the reduction (the first ``dim0 % size`` members get one row more).
    """
    del device_dense
    name = scoped_name(name, ignore_name_scope)
    compressed, ctx = compression.compress(tf.convert_to_tensor(tensor))
    out = _reducescatter(compressed, op, name, prescale_factor, postscale_factor, process_set)
    return compression.decompress(out, ctx)


def _reducescatter(x: tf.Tensor, op: int, name: str | None, pre: float, post: float,
                   process_set: ProcessSet) -> tf.Tensor:
    def fn(op_name: str | None, array: np.ndarray) -> np.ndarray:
        return _bridge.np_reducescatter(array, op_name, op, pre, post, process_set)

    @tf.custom_gradient
    def scatter(x: tf.Tensor) -> tuple[tf.Tensor, Callable[[tf.Tensor], tf.Tensor]]:
        out = _bridge.graph_call(fn, [x], x.dtype, "phalanx_reducescatter", name)
        out.set_shape(tf.TensorShape([None]).concatenate(x.shape[1:]))

        def grad(dy: tf.Tensor) -> tf.Tensor:
            dy = tf.convert_to_tensor(dy)
            if op == reduce_ops.Sum:
                dy = dy * tf.cast(process_set.size(), dy.dtype)
            return _dlpack.tf_allgather(dy, _grad_name(name), process_set)

        return out, grad

    return scatter(x)


def grouped_reducescatter(
    tensors: Sequence[object], device_dense: str = "", compression: type[Compressor] = Compression.none,
    op: int = reduce_ops.Average, process_set: ProcessSet = global_process_set, prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
) -> list[tf.Tensor]:
    """:func:`reducescatter` of each tensor, in order (Horovod's ``grouped_reducescatter``)."""
    return [reducescatter(t, device_dense, compression, op, f"grouped_reducescatter.{i}", process_set, True,
                          prescale_factor, postscale_factor) for i, t in enumerate(tensors)]


def broadcast_variables(variables: Sequence[VariableLike], root_rank: int, process_set: ProcessSet = global_process_set,
                        inplace: bool = False, name: str = "broadcast_variables") -> tf.Operation | None:
    """Assign ``root_rank``'s values to ``variables`` on every rank (one collective per dtype).

    Args:
        variables: ``tf.Variable`` or Keras variables, in the same order on every rank.
        root_rank: the global rank whose values win.
        process_set: the ranks taking part.
        inplace: Horovod's in-place broadcast (no temporary copies on the GPU); here the values always
            travel through one host buffer per dtype, so both settings do the same.
        name: prefix of the collective names (shown in errors).

    Returns:
        None eagerly; in a TensorFlow 1-style graph, the op that assigns the broadcast values.

    Raises:
        CollectiveMismatchError: ranks hold different variables (count, shapes or dtypes).
    """
    del inplace
    variables = list(variables)
    if not tf.executing_eagerly():
        return tf.group(*_graph_assigns(variables, root_rank, name, process_set))
    if not variables:
        return None
    groups: dict[str, list[tuple[VariableLike, np.ndarray]]] = {}
    for v in variables:
        array = np.asarray(v.numpy())
        groups.setdefault(array.dtype.name, []).append((v, array))
    for dtype_name, group in groups.items():
        flat = np.concatenate([a.reshape(-1) for _, a in group])
        synced = _bridge.np_broadcast(flat, root_rank, f"{name}.{dtype_name}", process_set)
        offset = 0
        for v, a in group:
            v.assign(synced[offset : offset + a.size].reshape(a.shape))
            offset += a.size
    return None


def _graph_assigns(variables: list[VariableLike], root_rank: int, name: str,
                   process_set: ProcessSet) -> list[object]:
    """In a TensorFlow 1-style graph: per variable, its assignment of ``root_rank``'s value (the assigned
    value, read after the assignment)."""
    return [v.assign(_dlpack.tf_broadcast(tf.convert_to_tensor(v), root_rank, f"{name}.{i}", process_set))
            for i, v in enumerate(variables)]
