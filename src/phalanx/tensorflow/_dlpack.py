"""The DLPack route from TensorFlow tensors to phalanx.torch's collectives, and the choice between it and the
numpy route (``_bridge``) for the dense ops (allreduce, the fused gradient allreduce, allgather, broadcast).

The numpy route hands a collective host arrays: ``tf.numpy_function`` copies a GPU tensor to the host, the CPU
transport reduces it, and TensorFlow copies the result back. This route hands torch the tensor's own memory
(``tf.experimental.dlpack.to_dlpack`` -> ``torch.from_dlpack``, on whatever device it is), runs the same
phalanx.torch collective on it (NCCL for CUDA tensors) and hands the result back the same way. Inside a graph
it runs as a ``tf.py_function``, whose body gets eager tensors on the op's device (TensorFlow places it on the
GPU with its inputs), where ``tf.numpy_function``'s body gets host arrays.

Invariants:
- The input's memory belongs to TensorFlow and is never written: every collective here writes new tensors.
- TensorFlow's ``to_dlpack`` returns once the tensor's data is ready; torch's work on a result finishes before
  TensorFlow gets it (TensorFlow's stream knows nothing of torch's).
- int32 tensors cross through host memory: TensorFlow keeps int32 "GPU" tensors in host memory.
- Both routes issue the same collectives under the same names (a fused buffer's name gains ``.cuda`` for a
  GPU buffer), so ranks agree as long as ``PHALANX_TF_DLPACK`` and their placement agree.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import numpy as np
import tensorflow as tf
import torch

import phalanx.torch as ptorch
from phalanx.env import settings
from phalanx.tensorflow import _bridge
from phalanx.torch import frontend
from phalanx.torch.process_sets import ProcessSet, global_process_set


def on_gpu(tensor: object) -> bool:
    """Whether an eager tensor lives on a GPU (its device is ``.../device:GPU:i``)."""
    return ":GPU:" in str(getattr(tensor, "device", "") or "").upper()


@functools.cache
def gpu_visible() -> bool:
    """Whether TensorFlow sees a GPU (then a graph's collectives may be placed on it)."""
    return bool(tf.config.list_logical_devices("GPU"))


def wanted(tensors: Sequence[tf.Tensor]) -> bool:
    """Whether ``tensors`` take the DLPack route: ``PHALANX_TF_DLPACK`` says always or never, else (``auto``)
    eagerly when one of them is on a GPU, in a graph when TensorFlow sees a GPU."""
    mode = settings.TF_DLPACK.get()
    if mode != "auto":
        return mode == "always"
    if tf.executing_eagerly():
        return any(on_gpu(t) for t in tensors)
    return gpu_visible()


def to_torch(tensor: tf.Tensor) -> torch.Tensor:
    """A torch tensor on ``tensor``'s memory and device (never written); int32 on a GPU goes through the host."""
    if tensor.dtype == tf.int32 and on_gpu(tensor):
        return torch.from_numpy(np.array(tensor))
    return torch.from_dlpack(tf.experimental.dlpack.to_dlpack(tensor))


def ready(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` once torch's queued work on its device has finished."""
    if tensor.is_cuda:
        torch.cuda.current_stream(tensor.device).synchronize()
    return tensor


def to_tf(tensor: torch.Tensor) -> tf.Tensor:
    """A TensorFlow tensor on ``tensor``'s memory (call :func:`ready` first for a CUDA result)."""
    return tf.experimental.dlpack.from_dlpack(torch.utils.dlpack.to_dlpack(tensor.contiguous()))


def _py_function(func: Callable[..., object], inp: list[tf.Tensor], Tout: tf.DType | list[tf.DType], stateful: bool,
                 name: str) -> tf.Tensor | list[tf.Tensor]:
    """``tf.py_function`` with ``tf.numpy_function``'s signature (a py_function is always stateful)."""
    del stateful
    return tf.py_function(func, inp, Tout=Tout, name=name)


def _call(body: Callable[..., tf.Tensor | list[tf.Tensor]], inputs: list[tf.Tensor], tout: tf.DType | list[tf.DType],
          op_name: str, name: str | None) -> tf.Tensor | list[tf.Tensor]:
    """``body(name, *tensors)``: eagerly, or as one ``tf.py_function`` in the graph being built."""
    if tf.executing_eagerly():
        return _bridge.eager(lambda: body(name, *inputs))
    return _bridge.numpy_op(body, inputs, tout, op_name, name, function=_py_function)


def _finish(handle: int) -> tf.Tensor:
    return to_tf(ready(_bridge._sync(handle)))


def tf_allreduce(tensor: tf.Tensor, name: str | None, op: int, pre: float = 1.0, post: float = 1.0,
                 process_set: ProcessSet = global_process_set) -> tf.Tensor:
    """``_bridge.tf_allreduce``, by DLPack when :func:`wanted`."""
    if not wanted([tensor]):
        return _bridge.tf_allreduce(tensor, name, op, pre, post, process_set)

    def fn(op_name: str, t: tf.Tensor) -> tf.Tensor:
        return _finish(ptorch.allreduce_async(to_torch(t), name=op_name, op=op, prescale_factor=pre,
                                              postscale_factor=post, process_set=process_set))

    return _shaped(_call(fn, [tensor], tensor.dtype, "phalanx_allreduce", name), tensor.shape)


def tf_allgather(tensor: tf.Tensor, name: str | None, process_set: ProcessSet = global_process_set) -> tf.Tensor:
    """``_bridge.tf_allgather``, by DLPack when :func:`wanted`."""
    if not wanted([tensor]):
        return _bridge.tf_allgather(tensor, name, process_set)

    def fn(op_name: str, t: tf.Tensor) -> tf.Tensor:
        return _finish(ptorch.allgather_async(to_torch(t), name=op_name, process_set=process_set))

    out = _call(fn, [tensor], tensor.dtype, "phalanx_allgather", name)
    return _shaped(out, tf.TensorShape([None]).concatenate(tensor.shape[1:]))


def tf_broadcast(tensor: tf.Tensor, root_rank: int, name: str | None,
                 process_set: ProcessSet = global_process_set) -> tf.Tensor:
    """``_bridge.tf_broadcast``, by DLPack when :func:`wanted`."""
    if not wanted([tensor]):
        return _bridge.tf_broadcast(tensor, root_rank, name, process_set)

    def fn(op_name: str, t: tf.Tensor) -> tf.Tensor:
        return _finish(ptorch.broadcast_async(to_torch(t), root_rank, name=op_name, process_set=process_set))

    return _shaped(_call(fn, [tensor], tensor.dtype, "phalanx_broadcast", name), tensor.shape)


def _shaped(out: tf.Tensor, shape: tf.TensorShape) -> tf.Tensor:
    if not tf.executing_eagerly():
        out.set_shape(shape)
    return out


def tf_fused_allreduce(tensors: list[tf.Tensor], name: str, op: int, pre: float = 1.0, post: float = 1.0,
                       process_set: ProcessSet = global_process_set) -> list[tf.Tensor]:
    """``_bridge.tf_fused_allreduce``, by DLPack when :func:`wanted`: one flat buffer per device and dtype,
    on that device, reduced in place."""
    if not wanted(tensors):
        return _bridge.tf_fused_allreduce(tensors, name, op, pre, post, process_set)

    def fn(op_name: str, *ts: tf.Tensor) -> list[tf.Tensor]:
        return fused_allreduce(list(ts), op_name, op, pre, post, process_set)

    outs = _call(fn, tensors, [t.dtype for t in tensors], "phalanx_fused_allreduce", name)
    return [_shaped(o, t.shape) for o, t in zip(outs, tensors)]


def fused_allreduce(tensors: list[tf.Tensor], name: str, op: int, pre: float, post: float,
                    process_set: ProcessSet) -> list[tf.Tensor]:
    """Allreduce eager tensors as one flat buffer per (device type, dtype), in first-seen order; as
    ``_bridge.np_fused_allreduce`` does for arrays (64-byte aligned slots, zeroed gaps, an Average over a
    power-of-two set divided while copying)."""
    xs = [to_torch(t) for t in tensors]
    groups: dict[tuple[str, torch.dtype], list[int]] = {}
    for i, x in enumerate(xs):
        groups.setdefault((x.device.type, x.dtype), []).append(i)
    out: list[tf.Tensor] = list(tensors)
    for (device, dtype), idx in groups.items():
        suffix = str(dtype).removeprefix("torch.") + ("" if device == "cpu" else f".{device}")
        reduced = _reduce_flat([xs[i] for i in idx], f"{name}.{suffix}", op, pre, post, process_set)
        for i, r in zip(idx, reduced):
            out[i] = to_tf(r)
    return out


def _slots(xs: list[torch.Tensor]) -> tuple[list[int], int]:
    """Each tensor's start in a flat buffer whose slots begin on ``_bridge.ALIGN_BYTES`` boundaries, and its
    length."""
    quantum = max(1, _bridge.ALIGN_BYTES // xs[0].element_size())
    starts, total = [], 0
    for x in xs:
        starts.append(total)
        total += -(-x.numel() // quantum) * quantum
    return starts, total


def _reduce_flat(xs: list[torch.Tensor], name: str, op: int, pre: float, post: float,
                 process_set: ProcessSet) -> list[torch.Tensor]:
    """One in-place allreduce of a new buffer holding ``xs`` (one device, one dtype); views of the result."""
    starts, total = _slots(xs)
    buffer = torch.empty(total, dtype=xs[0].dtype, device=xs[0].device)
    n = process_set.size() if op == frontend.Average else 1
    exact = op == frontend.Average and pre == 1.0 and xs[0].is_floating_point() and not n & (n - 1)
    for x, start, end in zip(xs, starts, [*starts[1:], total]):
        stop = start + x.numel()
        if exact:
            torch.mul(x.reshape(-1), 1.0 / n, out=buffer[start:stop])
        else:
            buffer[start:stop].copy_(x.reshape(-1))
        buffer[stop:end].zero_()
    handle = ptorch.allreduce_async_(buffer, name=name, op=op, prescale_factor=pre,
                                     postscale_factor=post * n if exact else post, process_set=process_set)
    ready(_bridge._sync(handle))
    return [buffer[s : s + x.numel()].view(x.shape) for x, s in zip(xs, starts)]
