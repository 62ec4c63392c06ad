"""Model and object helpers: ``broadcast_parameters``, ``broadcast_optimizer_state``, ``broadcast_object``,
``allgather_object`` (Horovod's ``horovod.torch.functions``)."""

from __future__ import annotations

import io
import pickle
from collections.abc import Mapping
from typing import Any

import torch

from phalanx.errors import InvalidArgumentError
from phalanx.torch import async_ops
from phalanx.torch._setup import state as _state
from phalanx.torch.process_sets import ProcessSet, global_process_set


def _dumps(obj: Any) -> bytes:
    try:
        return pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    except (pickle.PicklingError, AttributeError, TypeError):
        import cloudpickle  # lambdas and local classes, as Horovod allows

        return bytes(cloudpickle.dumps(obj))


@async_ops.runs_inline
def broadcast_object(obj: Any, root_rank: int = 0, name: str | None = None,
                     process_set: ProcessSet = global_process_set) -> Any:
    """Send a picklable object from ``root_rank`` to every member of the set.

    Args:
        obj: the object (only the root's value matters).
        root_rank: the global rank that sends.
        name: optional name for the collectives.
        process_set: the ranks taking part.

    Returns:
        The root's object on every member (the root gets its own object back).
    """
    me = _state.topology().rank
    payload = _dumps(obj) if me == root_rank else b""
    size = torch.tensor([len(payload)], dtype=torch.int64)
    async_ops.synchronize(async_ops.broadcast_async_(size, root_rank, f"{name}.size" if name else None, process_set))
    buf = torch.zeros(int(size.item()), dtype=torch.uint8)
    if me == root_rank:
        buf = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    async_ops.synchronize(async_ops.broadcast_async_(buf, root_rank, f"{name}.data" if name else None, process_set))
    return obj if me == root_rank else pickle.loads(buf.numpy().tobytes())


@async_ops.runs_inline
def allgather_object(obj: Any, name: str | None = None, process_set: ProcessSet = global_process_set) -> list[Any]:
    """Gather a picklable object from every member.

    Returns:
        The members' objects in rank order.
    """
    raw = torch.frombuffer(bytearray(_dumps(obj)), dtype=torch.uint8)
    count = torch.tensor([raw.numel()])
    sizes = async_ops.synchronize(async_ops.allgather_async(count, f"{name}.sizes" if name else None, process_set))
    data = async_ops.synchronize(async_ops.allgather_async(raw, f"{name}.data" if name else None, process_set))
    out, offset = [], 0
    for n in sizes.tolist():
        out.append(pickle.loads(data[offset : offset + n].numpy().tobytes()))
        offset += n
    return out


def _named_tensors(params: Any) -> list[tuple[str, torch.Tensor]]:
    if isinstance(params, Mapping):
        return sorted(params.items())
    items = list(params)
    if items and isinstance(items[0], torch.Tensor):
        return [(f"param.{i}", t) for i, t in enumerate(items)]
    return [(str(k), v) for k, v in items]


@async_ops.runs_inline
def broadcast_parameters(params: Any, root_rank: int, process_set: ProcessSet = global_process_set) -> None:
    """Overwrite every member's parameters/buffers in place with the root's.

    Args:
        params: ``model.state_dict()``, ``model.named_parameters()`` or a list of ``(name, tensor)``.
        root_rank: the global rank whose values win.
        process_set: the ranks taking part.

    Raises:
        ValueError: ``params`` is not one of the accepted forms.
    """
    named = [(k, v) for k, v in _named_tensors(params) if isinstance(v, torch.Tensor)]
    by_dtype: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
    for _, t in named:
        by_dtype.setdefault((t.dtype, t.device), []).append(t)
    handles = []
    for (dtype, device), tensors in by_dtype.items():
        # One fused broadcast per dtype: one signature check, one payload.
        flat = torch.cat([t.detach().reshape(-1) for t in tensors]) if tensors else torch.empty(0)
        handles.append((async_ops.broadcast_async_(flat, root_rank, f"broadcast_parameters.{dtype}.{device}",
                                                   process_set), flat, tensors))
    for handle, flat, tensors in handles:
        async_ops.synchronize(handle)
        offset = 0
        with torch.no_grad():
            for t in tensors:
                t.copy_(flat[offset : offset + t.numel()].view_as(t))
                offset += t.numel()


@async_ops.runs_inline
def broadcast_optimizer_state(optimizer: torch.optim.Optimizer, root_rank: int, model: torch.nn.Module | None = None,
                              process_set: ProcessSet = global_process_set) -> None:
    """Make every member's optimizer state (options and per-parameter state) equal to the root's.

    As in Horovod, an optimizer without state yet first gets it from one step on zero gradients (every
    parameter that requires a gradient gets a zero one; sparse for ``SparseAdam``, and for ``SGD`` on the
    sparse embeddings of ``model``), run by the wrapped optimizer alone (no gradient allreduce). The root's
    ``state_dict()`` then travels as one serialized object, so option types (floats, tuples such as Adam's
    ``betas``, bools) and state tensors arrive exactly as the root has them.

    Args:
        optimizer: a ``torch.optim`` optimizer or a ``DistributedOptimizer``.
        root_rank: the global rank whose state wins.
        model: optional; identifies the sparse parameters (``nn.Embedding(sparse=True)``).
        process_set: the ranks taking part (a phalanx extension; keyword).

    Raises:
        ValueError: ``optimizer`` is an LBFGS (as in Horovod).
    """
    if isinstance(optimizer, torch.optim.LBFGS):
        raise InvalidArgumentError(
            "cannot broadcast torch.optim.LBFGS state (as in Horovod); save and load it yourself")
    if not optimizer.state_dict()["state"]:
        _initialize_state(optimizer, model)
    payload = None
    if _state.topology().rank == root_rank:
        buf = io.BytesIO()
        torch.save(optimizer.state_dict(), buf)
        payload = buf.getvalue()
    data = broadcast_object(payload, root_rank, "broadcast_optimizer_state", process_set)
    if _state.topology().rank != root_rank:
        state = torch.load(io.BytesIO(data), weights_only=False)
        optimizer.load_state_dict(state)


def _initialize_state(optimizer: torch.optim.Optimizer, model: torch.nn.Module | None) -> None:
    """Create the optimizer's state with one step on zero gradients (Horovod's way; see the caller)."""
    sparse: set[int] = set()
    if model is not None:
        for m in model.modules():
            if isinstance(m, torch.nn.Embedding) and m.sparse:
                sparse.update(id(p) for p in m.parameters())
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.requires_grad:
                p.grad = torch.zeros_like(p)
                if isinstance(optimizer, torch.optim.SparseAdam) or (
                    isinstance(optimizer, torch.optim.SGD) and id(p) in sparse
                ):
                    p.grad = p.grad.to_sparse()
    if hasattr(optimizer, "_phalanx_setup"):  # a DistributedOptimizer: its step() would allreduce
        super(type(optimizer), optimizer).step()  # type: ignore[misc]
    else:
        optimizer.step()
