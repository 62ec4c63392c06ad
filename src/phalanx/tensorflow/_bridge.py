"""The bridge from TensorFlow tensors to phalanx.torch's collectives: numpy arrays through ``tf.numpy_function``.

TensorFlow hands a ``tf.numpy_function`` its inputs as numpy arrays (eagerly, or from inside a graph that
``model.fit`` traced); they become torch tensors without a copy (``torch.from_numpy``), go through
``phalanx.torch``'s collectives (so the signature check, the inline and speculative payloads and the
shared-memory transport all apply), and come back as numpy arrays. bfloat16 travels as its 16-bit pattern:
numpy has no bfloat16 of its own (TensorFlow's is ``ml_dtypes.bfloat16``), torch has one.

Why numpy_function and not a custom op: nothing is compiled, and the same code runs eagerly and in graphs.
XLA cannot compile it, so functions that call it must run with ``jit_compile=False``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar, overload

import numpy as np
import tensorflow as tf
import torch

import phalanx.torch as ptorch
from phalanx.env import settings
from phalanx.errors import CollectiveMismatchError, InvalidArgumentError
from phalanx.tensorflow import _pools
from phalanx.torch import frontend
from phalanx.torch.process_sets import ProcessSet, global_process_set

T = TypeVar("T")
#: ``tf.numpy_function``'s signature (``tf.py_function`` adapted to it): a graph op running a Python body.
GraphFunction = Callable[..., "tf.Tensor | list[tf.Tensor]"]

# Marks the errors a collective raised inside a graph, so model.fit's wrapper can re-raise them cleanly.
ERROR_MARK = "[phalanx collective error]"


def to_torch(array: np.ndarray) -> torch.Tensor:
    """A torch view of ``array`` (a copy only when it is not contiguous or is read-only); a 0-d array (a
    numpy scalar too) stays 0-d."""
    shape = np.shape(array)
    if np.size(array) == 0:  # TensorFlow hands empty arrays with zero strides, which torch cannot view as bytes
        array = np.empty(shape, dtype=np.asarray(array).dtype)
    array = np.ascontiguousarray(array)
    if not array.flags.writeable:
        array = array.copy()
    if array.dtype.name == "bfloat16":
        return torch.from_numpy(array.view(np.int16)).view(torch.bfloat16).reshape(shape)
    return torch.from_numpy(array).reshape(shape)


def to_numpy(tensor: torch.Tensor, like: np.dtype) -> np.ndarray:
    """``tensor`` as a numpy array of dtype ``like`` (bfloat16 by its bit pattern)."""
    if tensor.dtype == torch.bfloat16:
        return tensor.contiguous().view(torch.int16).numpy().view(like)
    return tensor.numpy()


_THREAD = threading.local()


def _same_threads_in_this_thread() -> None:
    # OpenMP's thread count is per calling thread: TensorFlow's executor threads would run torch's ops with
    # the default team (every core), so ranks sharing a host would oversubscribe its cores (an allreduce
    # from a TF thread slower than from the main thread). Apply the process's setting once per thread.
    if not getattr(_THREAD, "pinned", False):
        torch.set_num_threads(torch.get_num_threads())
        _THREAD.pinned = True


# The exception of the last collective that failed inside a graph (TensorFlow runs numpy_function bodies on
# its own threads, so this is process-wide; taken once by whoever handles the OpError around it).
_FAILED: list[BaseException | None] = [None]


class TFCollectiveMismatchError(CollectiveMismatchError, tf.errors.FailedPreconditionError):
    """Ranks disagree on a collective: phalanx's ``CollectiveMismatchError`` (a ``RuntimeError``) that is also
    the ``tf.errors.FailedPreconditionError`` Horovod's TensorFlow ops raise for it."""

    def __init__(self, message: str, node_def: object = None, op: object = None) -> None:
        CollectiveMismatchError.__init__(self, message)
        tf.errors.FailedPreconditionError.__init__(self, node_def, op, message)

    def __reduce__(self) -> tuple[type[TFCollectiveMismatchError], tuple[str]]:
        return (type(self), (self.message,))


class TFInvalidArgumentError(InvalidArgumentError, tf.errors.InvalidArgumentError):
    """A bad argument to a collective: phalanx's ``InvalidArgumentError`` (a ``ValueError``) that is also the
    ``tf.errors.InvalidArgumentError`` Horovod's TensorFlow ops raise for it."""

    def __init__(self, message: str, node_def: object = None, op: object = None) -> None:
        InvalidArgumentError.__init__(self, message)
        tf.errors.InvalidArgumentError.__init__(self, node_def, op, message)

    def __reduce__(self) -> tuple[type[TFInvalidArgumentError], tuple[str]]:
        return (type(self), (self.message,))


def as_tf_error(error: BaseException, node_def: object = None, op: object = None) -> BaseException:
    """``error`` with TensorFlow's error type as well, as Horovod's ops raise it (unchanged when it has one,
    or is not a mismatch or a bad argument)."""
    if isinstance(error, tf.errors.OpError):
        return error
    if isinstance(error, CollectiveMismatchError):
        return TFCollectiveMismatchError(str(error), node_def, op)
    if isinstance(error, InvalidArgumentError):
        return TFInvalidArgumentError(str(error), node_def, op)
    return error


def eager(fn: Callable[[], T]) -> T:
    """Run an eager collective; its mismatch and bad-argument errors get TensorFlow's types too."""
    try:
        return fn()
    except (CollectiveMismatchError, InvalidArgumentError) as e:
        raise as_tf_error(e) from e


def typed_op_error(error: Exception) -> Exception:
    """The error ``Session.run`` raises when a collective failed inside the graph: TensorFlow reports any
    Python exception in a ``tf.numpy_function`` as ``UnknownError`` (a bad argument as
    ``InvalidArgumentError``); a mismatch becomes the ``FailedPreconditionError`` Horovod's ops raise (also a
    ``CollectiveMismatchError``). Anything else is returned as it is."""
    if not isinstance(error, tf.errors.OpError) or ERROR_MARK not in error.message:
        return error
    original = take_error()
    if not isinstance(original, CollectiveMismatchError):
        return error
    return TFCollectiveMismatchError(error.message.replace(f"{ERROR_MARK} ", ""), error.node_def, error.op)


def take_error() -> BaseException | None:
    """The exception a collective raised inside a graph in the last failed call (once), so that the caller
    can re-raise it by its own type instead of TensorFlow's ``OpError`` around it."""
    error, _FAILED[0] = _FAILED[0], None
    return error


# When a rank last started a collective inside a graph (monotonic seconds): a rank whose graph collectives
# all wait and that has started none for the stall-warning time counts as blocked (see ``_rank_blocked``).
_LAST_START = [time.monotonic()]


def _rank_blocked() -> bool:
    """Whether this rank's graph can be taken to issue nothing more: none of TensorFlow's threads started a
    collective for the stall-warning time (``HOROVOD_STALL_CHECK_TIME_SECONDS``, 60 s by default). Until
    then another executor thread may still issue the collective a peer waits for."""
    quiet = settings.STALL_CHECK_TIME.get()
    return time.monotonic() - _LAST_START[0] > (60.0 if quiet is None or quiet <= 0 else quiet)


def _sync(handle: int) -> Any:  # Any: whatever ptorch.synchronize returns for the op (tensor or list)
    """The result of a started collective: eagerly as ``hvd.synchronize``; inside a graph through the
    background thread, so that TensorFlow's executor threads, which start a graph's independent collectives
    in a different order on each rank, never use the engine at once and never wait for each other."""
    if getattr(_THREAD, "graph", False):
        return frontend.synchronize_shared(handle, _rank_blocked)
    return ptorch.synchronize(handle)


def _guard(fn: Callable[..., T]) -> Callable[..., T]:
    """Run a collective inside a graph; a phalanx error keeps its text but gets ``ERROR_MARK`` (TF wraps it
    in an OpError), and the original exception is kept for :func:`take_error`."""

    def call(*args: np.ndarray) -> T:
        _same_threads_in_this_thread()
        _LAST_START[0] = time.monotonic()
        _THREAD.graph = True
        try:
            return fn(*args)
        except CollectiveMismatchError as e:
            _FAILED[0] = e
            raise CollectiveMismatchError(f"{ERROR_MARK} {e}") from e
        except Exception as e:
            _FAILED[0] = e
            raise
        finally:
            _THREAD.graph = False

    return call


@overload
def numpy_op(body: Callable[..., np.ndarray], inputs: list[tf.Tensor], tout: tf.DType, op_name: str,
             name: str | None, function: GraphFunction = ...) -> tf.Tensor: ...


@overload
def numpy_op(body: Callable[..., Sequence[np.ndarray]], inputs: list[tf.Tensor], tout: list[tf.DType],
             op_name: str, name: str | None, function: GraphFunction = ...) -> list[tf.Tensor]: ...


@overload
def numpy_op(body: Callable[..., object], inputs: list[tf.Tensor], tout: tf.DType | list[tf.DType], op_name: str,
             name: str | None, function: GraphFunction = ...) -> tf.Tensor | list[tf.Tensor]: ...


def numpy_op(body: Callable[..., object], inputs: list[tf.Tensor], tout: tf.DType | list[tf.DType], op_name: str,
             name: str | None, function: GraphFunction = tf.numpy_function) -> tf.Tensor | list[tf.Tensor]:
    """``body(name, *arrays)`` as one stateful ``tf.numpy_function`` named ``op_name`` in the graph being
    built (``function``: another of its kind, ``tf.py_function``'s signature with ``stateful``). An unnamed
    collective takes the TF op's name (unique in its graph, and the same on every rank, which builds the
    same graph), as Horovod names its ops: ranks whose executors start a graph's collectives in different
    orders still match them."""
    _pools.check_graph_pool()
    cell = [name]

    def fn(*arrays: np.ndarray) -> object:
        return body(cell[0], *arrays)

    out = function(_guard(fn), inputs, Tout=tout, stateful=True, name=op_name)
    if cell[0] is None:
        cell[0] = (out[0] if isinstance(out, (list, tuple)) else out).op.name
    return out


def np_allreduce(array: np.ndarray, name: str | None, op: int, pre: float, post: float,
                 process_set: ProcessSet = global_process_set) -> np.ndarray:
    """Allreduce a numpy array through phalanx.torch; returns a new array of the same dtype and shape."""
    handle = ptorch.allreduce_async(to_torch(array), name=name, op=op, prescale_factor=pre, postscale_factor=post,
                                    process_set=process_set)
    return to_numpy(_sync(handle), array.dtype)


def np_allgather(array: np.ndarray, name: str | None, process_set: ProcessSet = global_process_set) -> np.ndarray:
    """Concatenate every rank's array along dim 0."""
    out = _sync(ptorch.allgather_async(to_torch(array), name=name, process_set=process_set))
    return to_numpy(out, array.dtype)


def np_broadcast(array: np.ndarray, root_rank: int, name: str | None,
                 process_set: ProcessSet = global_process_set) -> np.ndarray:
    """``root_rank``'s array on every rank."""
    out = _sync(ptorch.broadcast_async(to_torch(array), root_rank, name=name, process_set=process_set))
    return to_numpy(out, array.dtype)


def tf_allreduce(tensor: tf.Tensor, name: str | None, op: int, pre: float = 1.0, post: float = 1.0,
                 process_set: ProcessSet = global_process_set) -> tf.Tensor:
    """Allreduce a dense TF tensor (eagerly or inside a graph); the result keeps its static shape."""
    if tf.executing_eagerly():
        return tf.convert_to_tensor(eager(lambda: np_allreduce(tensor.numpy(), name, op, pre, post, process_set)))

    def fn(op_name: str, a: np.ndarray) -> np.ndarray:
        return np_allreduce(a, op_name, op, pre, post, process_set)

    out = numpy_op(fn, [tensor], tensor.dtype, "phalanx_allreduce", name)
    out.set_shape(tensor.shape)
    return out


def tf_allgather(tensor: tf.Tensor, name: str | None, process_set: ProcessSet = global_process_set) -> tf.Tensor:
    """Allgather a TF tensor along dim 0 (dim 0 may differ between ranks)."""
    if tf.executing_eagerly():
        return tf.convert_to_tensor(eager(lambda: np_allgather(tensor.numpy(), name, process_set)))

    def fn(op_name: str, a: np.ndarray) -> np.ndarray:
        return np_allgather(a, op_name, process_set)

    out = numpy_op(fn, [tensor], tensor.dtype, "phalanx_allgather", name)
    out.set_shape(tf.TensorShape([None]).concatenate(tensor.shape[1:]))
    return out


def tf_broadcast(tensor: tf.Tensor, root_rank: int, name: str | None,
                 process_set: ProcessSet = global_process_set) -> tf.Tensor:
    """Broadcast a TF tensor from ``root_rank`` (a global rank)."""
    if tf.executing_eagerly():
        return tf.convert_to_tensor(eager(lambda: np_broadcast(tensor.numpy(), root_rank, name, process_set)))

    def fn(op_name: str, a: np.ndarray) -> np.ndarray:
        return np_broadcast(a, root_rank, op_name, process_set)

    out = numpy_op(fn, [tensor], tensor.dtype, "phalanx_broadcast", name)
    out.set_shape(tensor.shape)
    return out


# TensorFlow adopts a numpy_function's output array without copying it when its data is 64-byte aligned
# (EIGEN_MAX_ALIGN_BYTES); otherwise it copies. Each reduced tensor's slot in the flat buffer starts on
# such a boundary, so the results go back to TensorFlow as views of the buffer, without a copy.
ALIGN_BYTES = 64


@dataclass(frozen=True)
class _Group:
    """One dtype's flat buffer: which arrays go in it, where, and the collective's name."""

    dtype: np.dtype
    idx: tuple[int, ...]
    starts: tuple[int, ...]
    ends: tuple[int, ...]  # each slot's end (the next slot's start): the gap after an array is zeroed
    total: int
    name: str


_LAYOUTS: dict[tuple[object, ...], tuple[_Group, ...]] = {}


def _layout(arrays: list[np.ndarray], name: str) -> tuple[_Group, ...]:
    """The flat buffers of ``arrays`` (one per dtype, in first-seen order), cached per (name, dtypes, shapes):
    a training step passes the same gradients every time."""
    key = (name, *((a.dtype, a.shape) for a in arrays))
    layout = _LAYOUTS.get(key)
    if layout is None:
        if len(_LAYOUTS) >= 256:
            _LAYOUTS.clear()
        layout = _LAYOUTS[key] = _make_layout(arrays, name)
    return layout


def _make_layout(arrays: list[np.ndarray], name: str) -> tuple[_Group, ...]:
    by_dtype: dict[np.dtype, list[int]] = {}
    for i, a in enumerate(arrays):
        by_dtype.setdefault(a.dtype, []).append(i)
    groups = []
    for dtype, idx in by_dtype.items():
        quantum = max(1, ALIGN_BYTES // dtype.itemsize)
        starts, total = [], 0
        for i in idx:
            starts.append(total)
            total += -(-arrays[i].size // quantum) * quantum
        groups.append(_Group(dtype, tuple(idx), tuple(starts), (*starts[1:], total), total, f"{name}.{dtype.name}"))
    return tuple(groups)


def _aligned_empty(numel: int, dtype: np.dtype) -> np.ndarray:
    raw = np.empty(numel * dtype.itemsize + ALIGN_BYTES, dtype=np.uint8)
    start = -raw.ctypes.data % ALIGN_BYTES
    return raw[start : start + numel * dtype.itemsize].view(dtype)


def _folded_scale(op: int, pre: float, n: int, dtype: np.dtype) -> float | None:
    """``1/n`` when an Average's division can be applied while copying into the buffer: a numpy float dtype
    and ``n`` a power of two (the scaling is exact, so each rank's scaled contribution sums to the same
    bits as the scaled sum), and no prescale factor. Else None (the engine scales the result)."""
    if op != frontend.Average or pre != 1.0 or dtype.kind != "f" or n & (n - 1):
        return None
    return 1.0 / n


def np_fused_allreduce(arrays: list[np.ndarray], name: str, op: int, pre: float, post: float,
                       process_set: ProcessSet = global_process_set) -> list[np.ndarray]:
    """Allreduce many arrays as one flat buffer per dtype (one collective each, in first-seen dtype order).

    Each array is copied once into its 64-byte aligned slot of a fresh buffer (the gaps are zeros), the
    buffer is reduced in place, and the results are views of it (TensorFlow takes aligned views as they are).
    An Average over a power-of-two number of ranks is divided while copying (one pass over the gradients
    less); the collective still says Average (with the division folded into its postscale factor), so ranks
    that disagree on the op still fail the signature check.
    """
    out: list[np.ndarray] = list(arrays)
    n = process_set.size() if op == frontend.Average else 1
    for group in _layout(arrays, name):
        buffer = _aligned_empty(group.total, group.dtype)
        scale = _folded_scale(op, pre, n, group.dtype)
        for i, start, end in zip(group.idx, group.starts, group.ends):
            stop = start + arrays[i].size
            if scale is None:
                np.copyto(buffer[start:stop], arrays[i].reshape(-1))
            else:
                np.multiply(arrays[i].reshape(-1), scale, out=buffer[start:stop])
            if stop < end:
                buffer[stop:end] = 0
        handle = ptorch.allreduce_async_(to_torch(buffer), name=group.name, op=op, prescale_factor=pre,
                                         postscale_factor=post if scale is None else post * n,
                                         process_set=process_set)
        _sync(handle)
        for i, start in zip(group.idx, group.starts):
            out[i] = buffer[start : start + arrays[i].size].reshape(arrays[i].shape)
    return out


def tf_fused_allreduce(tensors: list[tf.Tensor], name: str, op: int, pre: float = 1.0, post: float = 1.0,
                       process_set: ProcessSet = global_process_set) -> list[tf.Tensor]:
    """Allreduce dense TF tensors with one ``tf.numpy_function`` call (one collective per dtype inside)."""
    if tf.executing_eagerly():
        arrays = eager(lambda: np_fused_allreduce([t.numpy() for t in tensors], name, op, pre, post, process_set))
        return [tf.convert_to_tensor(a) for a in arrays]

    def fn(op_name: str, *arrays: np.ndarray) -> list[np.ndarray]:
        return np_fused_allreduce(list(arrays), op_name, op, pre, post, process_set)

    outs = numpy_op(fn, tensors, [t.dtype for t in tensors], "phalanx_fused_allreduce", name)
    for out, t in zip(outs, tensors):
        out.set_shape(t.shape)
    return list(outs)


def np_reducescatter(array: np.ndarray, name: str | None, op: int, pre: float, post: float,
                     process_set: ProcessSet = global_process_set) -> np.ndarray:
    """Reduce ``array`` across the set and keep this member's block of dim 0 (the first members get the
    extra rows when dim 0 does not divide evenly)."""
    handle = ptorch.reducescatter_async(to_torch(array), name=name, op=op, process_set=process_set,
                                        prescale_factor=pre, postscale_factor=post)
    return to_numpy(_sync(handle), array.dtype)


def np_alltoall(array: np.ndarray, splits: np.ndarray | None, name: str | None,
                process_set: ProcessSet = global_process_set) -> tuple[np.ndarray, np.ndarray]:
    """Send ``splits[i]`` rows of ``array`` to the i-th member; returns (received rows, received splits)."""
    counts = None if splits is None or splits.size == 0 else [int(s) for s in splits.reshape(-1)]
    result = _sync(ptorch.alltoall_async(to_torch(array), splits=counts, name=name,
                                                      process_set=process_set))
    out, received = result if isinstance(result, tuple) else (result, None)
    if received is None:
        received = torch.tensor([out.shape[0] // process_set.size()] * process_set.size())
    return to_numpy(out, array.dtype), np.asarray(received.tolist(), dtype=np.int32)


def np_grouped_allgather(arrays: list[np.ndarray], name: str | None,
                         process_set: ProcessSet = global_process_set) -> list[np.ndarray]:
    """Allgather each array along dim 0, as one grouped collective."""
    handle = ptorch.grouped_allgather_async([to_torch(a) for a in arrays], name=name, process_set=process_set)
    return [to_numpy(t, a.dtype) for t, a in zip(_sync(handle), arrays)]


@overload
def graph_call(fn: Callable[..., np.ndarray], inputs: list[tf.Tensor], tout: tf.DType, op_name: str,
               name: str | None) -> tf.Tensor: ...


@overload
def graph_call(fn: Callable[..., Sequence[np.ndarray]], inputs: list[tf.Tensor], tout: list[tf.DType],
               op_name: str, name: str | None) -> list[tf.Tensor]: ...


def graph_call(fn: Callable[..., np.ndarray | Sequence[np.ndarray]], inputs: list[tf.Tensor],
               tout: tf.DType | list[tf.DType], op_name: str, name: str | None) -> tf.Tensor | list[tf.Tensor]:
    """``fn(name, *arrays)`` over ``inputs``: eagerly on numpy arrays, or as one stateful
    ``tf.numpy_function`` in a graph (see :func:`numpy_op`; a phalanx error inside it keeps its text and gets
    ``ERROR_MARK``)."""
    if tf.executing_eagerly():
        out = eager(lambda: fn(name, *[t.numpy() for t in inputs]))
        return [tf.convert_to_tensor(o) for o in out] if isinstance(out, (list, tuple)) else tf.convert_to_tensor(out)
    return numpy_op(fn, inputs, tout, op_name, name)
