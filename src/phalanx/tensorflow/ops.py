"""Collectives on TensorFlow tensors (Horovod's ``horovod.tensorflow`` names), eager or inside ``tf.function``.

Every op runs on ``phalanx.torch``'s collectives (see ``_bridge``): the same order rule and the same
cross-rank signature check, so ranks that disagree get ``CollectiveMismatchError`` instead of a hang.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import tensorflow as tf

from phalanx.tensorflow import _bridge
from phalanx.tensorflow.compression import Compression, Compressor
from phalanx.torch import _reduce as R
from phalanx.torch.process_sets import ProcessSet, global_process_set


def _dense(tensor: Any) -> tf.Tensor:
    # IndexedSlices (an Embedding's gradient) are reduced densely, as phalanx.torch does with sparse grads.
    return tf.convert_to_tensor(tensor)


def allreduce(
    tensor: Any, average: bool | None = None, device_dense: str = "", device_sparse: str = "",
    compression: type[Compressor] = Compression.none, op: int | None = None, prescale_factor: float = 1.0,
    postscale_factor: float = 1.0, name: str | None = None, process_set: ProcessSet = global_process_set,
) -> tf.Tensor:  # fmt: skip
    """Allreduce a tensor across the set (``hvd.allreduce``); eager or in a graph.

    Args:
        tensor: a ``tf.Tensor``, variable, ``tf.IndexedSlices`` (reduced densely) or array-like.
        average: deprecated; True means ``op=Average``, False ``op=Sum``.
        device_dense: accepted for Horovod compatibility (tensors travel through host memory).
        device_sparse: accepted for Horovod compatibility.
        compression: ``Compression.none`` or ``Compression.fp16``.
        op: ``Average`` (default), ``Sum``, ``Min``, ``Max`` or ``Product``.
        prescale_factor: multiply inputs by this before reducing.
        postscale_factor: multiply the result by this.
        name: optional name, shown in errors.
        process_set: the ranks taking part.

    Returns:
        The reduced tensor (same dtype and shape).

    Raises:
        ValueError: before ``hvd.init()`` or on a bad op.
        CollectiveMismatchError: ranks disagree on shape, dtype, op, ... (on every rank).
    """
    op_ = R.resolve_op(op, average)
    compressed, ctx = compression.compress(_dense(tensor))
    out = _bridge.tf_allreduce(compressed, name, op_, prescale_factor, postscale_factor, process_set)
    return compression.decompress(out, ctx)


def grouped_allreduce(
    tensors: Sequence[Any], average: bool | None = None, compression: type[Compressor] = Compression.none,
    op: int | None = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0, name: str | None = None,
    process_set: ProcessSet = global_process_set,
) -> list[tf.Tensor | None]:  # fmt: skip
    """Allreduce several tensors as one flat buffer per dtype (one collective per dtype); None stays None.

    Returns:
        The reduced tensors, in order.
    """
    return fused_allreduce(list(tensors), R.resolve_op(op, average), compression, name or "grouped_allreduce",
                           prescale_factor, postscale_factor, process_set)  # fmt: skip


def fused_allreduce(
    tensors: list[Any], op: int, compression: type[Compressor], name: str, pre: float = 1.0, post: float = 1.0,
    process_set: ProcessSet = global_process_set,
) -> list[tf.Tensor | None]:  # fmt: skip
    """The fusion behind ``DistributedOptimizer``: one ``tf.numpy_function`` call, one collective per dtype.

    Compression applies to each tensor (in TF); the concatenation into one buffer per dtype, the reduction
    and the split happen in numpy/torch inside the call (TF's own concat + split cost more than the
    allreduce of a 1.2M-parameter CNN on this machine).

    Args:
        tensors: tensors (None entries are passed through).
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
    packed = [compression.compress(_dense(tensors[i])) for i in present]
    reduced = _bridge.tf_fused_allreduce([p[0] for p in packed], name, op, pre, post, process_set)
    for i, r, (_, ctx) in zip(present, reduced, packed):
        out[i] = compression.decompress(r, ctx)
    return out


def allgather(tensor: Any, name: str | None = None, process_set: ProcessSet = global_process_set) -> tf.Tensor:
    """Concatenate every rank's tensor along dim 0 (dim 0 may differ between ranks), in rank order."""
    return _bridge.tf_allgather(tf.convert_to_tensor(tensor), name, process_set)


def broadcast(tensor: Any, root_rank: int, name: str | None = None,
              process_set: ProcessSet = global_process_set) -> tf.Tensor:  # fmt: skip
    """Return ``root_rank``'s tensor (a global rank) on every rank of the set."""
    return _bridge.tf_broadcast(tf.convert_to_tensor(tensor), root_rank, name, process_set)


def broadcast_variables(variables: Sequence[Any], root_rank: int, process_set: ProcessSet = global_process_set,
                        name: str = "broadcast_variables") -> None:  # fmt: skip
    """Assign ``root_rank``'s values to ``variables`` on every rank (one collective per dtype).

    Args:
        variables: ``tf.Variable`` or Keras variables, in the same order on every rank.
        root_rank: the global rank whose values win.
        process_set: the ranks taking part.
        name: prefix of the collective names (shown in errors).

    Raises:
        CollectiveMismatchError: ranks hold different variables (count, shapes or dtypes).
    """
    variables = list(variables)
    if not variables:
        return
    groups: dict[str, list[tuple[Any, np.ndarray]]] = {}
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
