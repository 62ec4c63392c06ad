"""The training loop every rank of a ``TorchEstimator`` run executes (runs in the phalanx worker)."""

from __future__ import annotations

import io
from collections.abc import Callable, Sequence
from typing import Any

import cloudpickle
import torch

import phalanx.torch as hvd
from phalanx.spark.driver_log import log_to_driver
from phalanx.spark.estimator.job import EpochRecord, TrainResult, TrainSpec, epoch_line
from phalanx.spark.estimator.reader import Batch
from phalanx.spark.estimator.schema import ColumnSpec, Shapes, row_shape

#: A model's outputs: one tensor, or one per label column.
Outputs = torch.Tensor | list[torch.Tensor] | tuple[torch.Tensor, ...]


def tensors(batch: Batch, specs: Sequence[ColumnSpec], shapes: Shapes | None,
            device: torch.device) -> list[torch.Tensor]:
    """The batch's columns as tensors shaped ``(rows, *shape)`` on ``device``."""
    out = []
    for i, spec in enumerate(specs):
        array = batch[spec.name]
        shape = row_shape(spec, shapes[i] if shapes else None)
        out.append(torch.from_numpy(array).reshape(len(array), *shape).to(device))
    return out


def shaped_labels(outputs: Outputs, labels: list[torch.Tensor], given: bool) -> list[torch.Tensor]:
    """Horovod's rule: without ``label_shapes``, a label takes its output's shape when their element counts
    match (a ``[batch]`` label column against a ``[batch, 1]`` output)."""
    if given:
        return labels
    outs = list(outputs) if isinstance(outputs, (list, tuple)) else [outputs]
    return [label.reshape(out.shape) if hasattr(out, "shape") and out.shape.numel() == label.numel() else label
            for out, label in zip(outs, labels)]


def compute_loss(spec: TrainSpec, outputs: Outputs, labels: list[torch.Tensor], weights: torch.Tensor | None,
                 ) -> torch.Tensor:
    """Horovod's rule: one loss per label (or one for all), weighted by ``loss_weights``; with sample weights
    each loss is called with ``reduction='none'`` (``F.binary_cross_entropy``, ``torch.nn.MSELoss()``...),
    its per-element values flattened, multiplied by the rows' weights and averaged."""
    outs = list(outputs) if isinstance(outputs, (list, tuple)) else [outputs]
    fns = spec.params["loss"]
    fns = list(fns) if isinstance(fns, (list, tuple)) else [fns] * len(labels)
    factors = spec.params.get("loss_weights") or [1.0] * len(labels)
    total: Any = 0.0
    for fn, out, label, factor in zip(fns, outs, labels, factors):
        if weights is None:
            value = fn(out, label)
        else:
            value = (_unreduced(fn, out, label).flatten() * weights.flatten()).mean()
        total = total + factor * value
    return total


def _unreduced(fn: Callable[..., torch.Tensor], out: torch.Tensor, label: torch.Tensor) -> torch.Tensor:
    """``fn(out, label, reduction='none')``, or a loss module's own ``reduction`` set to ``'none'``."""
    if isinstance(fn, torch.nn.Module) and hasattr(fn, "reduction"):
        kept = fn.reduction
        setattr(fn, "reduction", "none")  # noqa: B010 (a loss module's attribute, typed str by torch)
        try:
            return fn(out, label)
        finally:
            setattr(fn, "reduction", kept)  # noqa: B010
    return fn(out, label, reduction="none")


def _metrics(spec: TrainSpec, outputs: Outputs, labels: list[torch.Tensor]) -> dict[str, float]:
    outs = list(outputs) if isinstance(outputs, (list, tuple)) else [outputs]
    found = {}
    for fn in spec.params.get("metrics") or []:
        name = getattr(fn, "__name__", type(fn).__name__)
        found[name] = float(sum(float(fn(o, lab)) for o, lab in zip(outs, labels)) / len(labels))
    return found


def run_epoch(spec: TrainSpec, model: torch.nn.Module, optimizer: torch.optim.Optimizer, epoch: int,
              device: torch.device, validation: bool) -> tuple[dict[str, float], int]:
    """One epoch (training or validation) on this rank: the metrics averaged over its steps, and the steps."""
    data = spec.data
    model.train(not validation)
    sums: dict[str, float] = {}
    steps = 0
    passes = int(spec.params.get("backward_passes_per_step") or 1)
    shapes = spec.params.get("label_shapes")
    for batch in spec.batches(hvd.rank(), hvd.size(), epoch, validation):
        inputs = tensors(batch, data.features, spec.params.get("input_shapes"), device)
        labels = tensors(batch, data.labels, shapes, device)
        weights = tensors(batch, [data.weight], None, device)[0] if data.weight else None
        with torch.set_grad_enabled(not validation):
            outputs = model(*inputs)
            labels = shaped_labels(outputs, labels, bool(shapes))
            loss = compute_loss(spec, outputs, labels, weights)
        if not validation:
            if steps % passes == 0:
                optimizer.zero_grad()
            (loss / passes if passes > 1 else loss).backward()
            if (steps + 1) % passes == 0:
                optimizer.step()
        for name, value in {"loss": float(loss.detach()), **_metrics(spec, outputs.detach(), labels)}.items():
            sums[name] = sums.get(name, 0.0) + value
        steps += 1
    if not validation and steps % passes:
        optimizer.step()  # the epoch's last, incomplete group of backward passes
    means = {k: v / steps for k, v in sums.items()}
    averaged = hvd.allreduce(torch.tensor(list(means.values()), dtype=torch.float64), op=hvd.Average,
                             name=f"estimator.{'val' if validation else 'train'}.{epoch}")
    return dict(zip(means, averaged.tolist())), steps


def _restore(spec: TrainSpec, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[EpochRecord]:
    if spec.resume_epoch < 0:
        return []
    state = torch.load(io.BytesIO(spec.store.read(spec.checkpoint_path(spec.resume_epoch))), weights_only=False)
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    return list(state["history"])


def _save(spec: TrainSpec, model: torch.nn.Module, optimizer: torch.optim.Optimizer, epoch: int,
          history: list[EpochRecord]) -> None:
    buffer = io.BytesIO()
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "history": history,
                "epoch": epoch}, buffer)
    spec.store.write(spec.checkpoint_path(epoch), buffer.getvalue())
    spec.log_epoch(history[-1])


def _device(spec: TrainSpec) -> torch.device:
    if spec.params.get("use_gpu") and torch.cuda.is_available():
        torch.cuda.set_device(hvd.local_rank())
        return torch.device("cuda", hvd.local_rank())
    return torch.device("cpu")


def train(spec: TrainSpec) -> TrainResult:
    """Train on this rank's shard; rank 0 checkpoints every epoch. Returns the history, this rank's steps
    per epoch, and (rank 0) the final model's ``state_dict`` as ``torch.save`` bytes."""
    hvd.init()
    if spec.params.get("random_seed") is not None:
        torch.manual_seed(int(spec.params["random_seed"]))
    model, optimizer = cloudpickle.loads(spec.model_blob)
    history = _restore(spec, model, optimizer)
    device = _device(spec)
    model.to(device)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    compression = spec.params.get("gradient_compression") or hvd.Compression.none
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                         compression=compression,
                                         backward_passes_per_step=int(spec.params.get("backward_passes_per_step")
                                                                      or 1))
    epochs, steps = int(spec.params["epochs"]), []
    for epoch in range(spec.resume_epoch + 1, epochs):
        record: EpochRecord = {"epoch": epoch}
        record["train"], taken = run_epoch(spec, model, optimizer, epoch, device, validation=False)
        record["steps"] = taken
        record["steps_per_rank"] = hvd.allgather_object(taken)
        steps.append(taken)
        if spec.data.val:
            with torch.no_grad():
                record["validation"], _ = run_epoch(spec, model, optimizer, epoch, device, validation=True)
        history.append(record)
        if hvd.rank() == 0:
            _save(spec, model, optimizer, epoch, history)
            if int(spec.params.get("verbose") or 0) > 0:
                log_to_driver(epoch_line(record, epochs))
        for callback in spec.params.get("callbacks") or []:
            callback(epoch, record)
    result: TrainResult = {"history": history, "steps": steps}
    if hvd.rank() == 0:
        buffer = io.BytesIO()
        torch.save(model.cpu().state_dict(), buffer)
        result["state"] = buffer.getvalue()
    return result
