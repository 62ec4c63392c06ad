"""What the driver sends each rank of an estimator run, and the epoch bookkeeping every framework shares."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, TypedDict

from phalanx.spark.estimator.prepare import Prepared
from phalanx.spark.estimator.reader import Batch, ShardReader, steps_per_epoch
from phalanx.spark.estimator.store import Store


class EpochRecord(TypedDict, total=False):
    """One epoch's metrics, as the ranks log and return them (``getHistory()``'s entries)."""

    epoch: int
    train: dict[str, float]
    validation: dict[str, float]
    steps: int
    steps_per_rank: list[int]


class TrainResult(TypedDict, total=False):
    """What a rank's training function returns: the history and steps per epoch; rank 0 also its trained
    state (the framework's bytes)."""

    history: list[EpochRecord]
    steps: list[int]
    state: bytes


@dataclass(frozen=True)
class TrainSpec:
    """One estimator run, as every rank receives it (pickled with the job's payload).

    Attributes:
        model_blob: the framework's serialized model (and optimizer).
        data: the run's data (columns and row groups).
        store, run_id: where the data, checkpoints and logs are.
        params: the estimator's parameter values (the ``PARAMS`` names): the user's model, optimizer, loss
            and callbacks as well as settings, so typed ``Any``.
        resume_epoch: the last finished epoch of an interrupted run (its checkpoint is loaded), or -1.
    """

    model_blob: bytes
    data: Prepared
    store: Store
    run_id: str
    params: dict[str, Any] = field(default_factory=dict)
    resume_epoch: int = -1

    def reader(self, rank: int, size: int, validation: bool) -> ShardReader:
        """The rank's reader of the training or validation rows."""
        p = self.params
        columns = [*self.data.features, *self.data.labels, *([self.data.weight] if self.data.weight else [])]
        pieces = self.data.val if validation else self.data.train
        batch = self.val_batch_size if validation else int(p["batch_size"])
        return ShardReader(self.store.open_read, pieces, columns, rank, size, batch,
                           bool(p["shuffle"]) and not validation, int(p.get("random_seed") or 0))

    @property
    def val_batch_size(self) -> int:
        """``val_batch_size``, defaulting to ``batch_size`` (Horovod's rule)."""
        return int(self.params.get("val_batch_size") or self.params["batch_size"])

    def steps(self, size: int, validation: bool) -> int:
        """Batches per epoch on every rank (``reader.steps_per_epoch``)."""
        if validation:
            return steps_per_epoch(self.data.val_rows, self.val_batch_size, size,
                                   self.params.get("validation_steps_per_epoch"), training=False)
        return steps_per_epoch(self.data.train_rows, int(self.params["batch_size"]), size,
                               self.params.get("train_steps_per_epoch"), training=True)

    def batches(self, rank: int, size: int, epoch: int, validation: bool) -> Iterator[Batch]:
        """This epoch's batches for the rank, after the user's ``transformation_fn``."""
        transform: Callable[[Batch], Batch] | None = self.params.get("transformation_fn")
        for batch in self.reader(rank, size, validation).epoch(epoch, self.steps(size, validation)):
            yield transform(batch) if transform is not None else batch

    def log_epoch(self, record: EpochRecord) -> None:
        """Append one epoch's metrics to the run's ``logs/history.jsonl`` (rank 0 calls it)."""
        path = f"{self.store.get_logs_path(self.run_id)}/history.jsonl"
        self.store.append_text(path, json.dumps(record) + "\n")

    def checkpoint_path(self, epoch: int) -> str:
        """Where epoch ``epoch``'s checkpoint goes."""
        return f"{self.store.get_checkpoint_path(self.run_id)}/{self.store.get_checkpoint_filename(epoch)}"


def epoch_line(record: EpochRecord, epochs: int) -> str:
    """One line for the driver's console: ``epoch 2/5: loss=0.41 val_loss=0.38 (96 steps)``."""
    parts = [f"{k}={v:.4g}" for k, v in record["train"].items()]
    parts += [f"val_{k}={v:.4g}" for k, v in record.get("validation", {}).items()]
    return f"epoch {record['epoch'] + 1}/{epochs}: {' '.join(parts)} ({record['steps']} steps)"
