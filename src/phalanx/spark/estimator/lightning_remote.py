"""The training every rank of a Lightning ``TorchEstimator`` run executes: one ``Trainer.fit`` with phalanx's
``HorovodStrategy`` (``strategy="horovod"``, on phalanx.torch, as Horovod's estimator uses Horovod's), fed
from the rank's shard."""

from __future__ import annotations

import importlib
import importlib.util
import io
import os
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import cloudpickle
import torch

from phalanx.env import names as env_names
from phalanx.errors import InvalidArgumentError
from phalanx.lightning.flavours import FLAVOURS
from phalanx.spark.driver_log import log_to_driver
from phalanx.spark.estimator.job import EpochRecord, TrainResult, TrainSpec, epoch_line
from phalanx.spark.estimator.schema import row_shape

if TYPE_CHECKING:
    import lightning.pytorch as pl


class ShardDataset(torch.utils.data.IterableDataset):
    """The rank's batches of one epoch as dicts ``column -> tensor`` (Horovod's Lightning batch format)."""

    def __init__(self, spec: TrainSpec, rank: int, size: int, validation: bool) -> None:
        self.spec, self.rank, self.size, self.validation = spec, rank, size, validation
        self.epoch = 0
        self.taken = 0

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        data = self.spec.data
        shapes = self.spec.params.get("input_shapes")
        specs = [*data.features, *data.labels, *([data.weight] if data.weight else [])]
        for batch in self.spec.batches(self.rank, self.size, self.epoch, self.validation):
            out = {}
            for spec in specs:
                index = data.features.index(spec) if spec in data.features else -1
                shape = row_shape(spec, shapes[index] if shapes and index >= 0 else None)
                array = batch[spec.name]
                out[spec.name] = torch.from_numpy(array).reshape(len(array), *shape)
            self.taken += 0 if self.validation else 1
            yield out

    def __len__(self) -> int:
        return self.spec.steps(self.size, self.validation)


# L: the Lightning package the module's Trainer comes from (lightning.pytorch or pytorch_lightning), chosen at
# run time; typed Any because its Callback is the base class of the callbacks defined here.
def _callback(L: Any, spec: TrainSpec, train_set: ShardDataset, val_set: ShardDataset | None,
              history: list[EpochRecord]) -> object:
    class StoreCallback(L.Callback):
        """Sets each epoch's shuffle, records metrics, checkpoints into the store (rank 0)."""

        def on_train_start(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
            if spec.resume_epoch >= 0:
                state = torch.load(io.BytesIO(spec.store.read(spec.checkpoint_path(spec.resume_epoch))),
                                   weights_only=False)
                for optimizer, saved in zip(trainer.optimizers, state["optimizers"]):
                    optimizer.load_state_dict(saved)

        def on_train_epoch_start(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
            epoch = spec.resume_epoch + 1 + trainer.current_epoch
            train_set.epoch = epoch
            train_set.taken = 0
            if val_set is not None:
                val_set.epoch = epoch

        def on_train_epoch_end(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
            epoch = spec.resume_epoch + 1 + trainer.current_epoch
            metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
            record: EpochRecord = {"epoch": epoch, "steps": train_set.taken,
                                   "train": {k: v for k, v in metrics.items() if not k.startswith("val_")}}
            val = {k[4:]: v for k, v in metrics.items() if k.startswith("val_")}
            if val:
                record["validation"] = val
            gathered = trainer.strategy.all_gather(torch.tensor([train_set.taken]))
            record["steps_per_rank"] = [int(v) for v in gathered.flatten().tolist()]
            history.append(record)
            if trainer.global_rank == 0:
                buffer = io.BytesIO()
                torch.save({"model": module.state_dict(), "optimizers": [o.state_dict() for o in trainer.optimizers],
                            "history": history, "epoch": epoch}, buffer)
                spec.store.write(spec.checkpoint_path(epoch), buffer.getvalue())
                spec.log_epoch(record)
                if int(spec.params.get("verbose") or 0) > 0:
                    log_to_driver(epoch_line(record, int(spec.params["epochs"])))

    return StoreCallback()


def _nan_guard(L: Any) -> object:
    class TerminateOnNaN(L.Callback):
        """Lightning 1.x's ``terminate_on_nan``: a ``ValueError`` at the end of the training batch whose
        loss, or any parameter after it, is NaN or inf."""

        # outputs: what training_step returned (Lightning's STEP_OUTPUT: a tensor, a mapping, or None)
        def on_train_batch_end(self, trainer: pl.Trainer, module: pl.LightningModule, outputs: Any,
                               batch: dict[str, torch.Tensor], batch_idx: int) -> None:
            loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
            if loss is not None and not bool(torch.isfinite(torch.as_tensor(loss)).all()):
                raise InvalidArgumentError(f"the loss returned in training_step is {float(loss)} (batch {batch_idx}); "
                                           "terminate_on_nan=True stopped the training")
            for name, parameter in module.named_parameters():
                if not bool(torch.isfinite(parameter).all()):
                    raise InvalidArgumentError(f"parameter {name} is NaN or inf after batch {batch_idx}; "
                                               "terminate_on_nan=True stopped the training")

    return TerminateOnNaN()


def flavour_of(module: object) -> str | None:
    """The Lightning package whose ``LightningModule`` ``module`` is (``lightning.pytorch`` or the standalone
    ``pytorch_lightning``), or None; the run trains it with that package's Trainer."""
    for flavour in FLAVOURS:
        if importlib.util.find_spec(flavour.split(".")[0]) is None:
            continue
        if isinstance(module, importlib.import_module(flavour).LightningModule):
            return flavour
    return None


def _restore(spec: TrainSpec, module: torch.nn.Module) -> list[EpochRecord]:
    if spec.resume_epoch < 0:
        return []
    state = torch.load(io.BytesIO(spec.store.read(spec.checkpoint_path(spec.resume_epoch))), weights_only=False)
    module.load_state_dict(state["model"])
    return list(state["history"])


def train(spec: TrainSpec) -> TrainResult:
    """Fit the LightningModule on this rank's shard; returns the history, the steps, and (rank 0) the
    trained ``state_dict`` as ``torch.save`` bytes."""
    import phalanx.lightning  # noqa: F401 (registers strategy="horovod")

    rank, size = int(os.environ[env_names.RANK]), int(os.environ[env_names.WORLD_SIZE])
    module = cloudpickle.loads(spec.model_blob)
    L = importlib.import_module(flavour_of(module) or "lightning.pytorch")  # the module's own Trainer
    if spec.params.get("random_seed") is not None:
        L.seed_everything(int(spec.params["random_seed"]), verbose=False)
    history = _restore(spec, module)
    train_set = ShardDataset(spec, rank, size, validation=False)
    val_set = ShardDataset(spec, rank, size, validation=True) if spec.data.val else None
    gpu = bool(spec.params.get("use_gpu")) and torch.cuda.is_available()
    trainer = L.Trainer(
        max_epochs=int(spec.params["epochs"]) - spec.resume_epoch - 1, accelerator="gpu" if gpu else "cpu",
        strategy="horovod",
        limit_train_batches=len(train_set), limit_val_batches=len(val_set) if val_set is not None else 0,
        num_sanity_val_steps=0, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, use_distributed_sampler=False,
        profiler=spec.params.get("profiler"),
        callbacks=[_callback(L, spec, train_set, val_set, history),
                   *([_nan_guard(L)] if spec.params.get("terminate_on_nan") else []),
                   *(spec.params.get("callbacks") or [])])
    loader = torch.utils.data.DataLoader(train_set, batch_size=None)
    val_loader = torch.utils.data.DataLoader(val_set, batch_size=None) if val_set is not None else None
    if trainer.max_epochs and trainer.max_epochs > 0:
        trainer.fit(module, loader, val_loader)
    result: TrainResult = {"history": history, "steps": [h["steps"] for h in history]}
    if rank == 0:
        buffer = io.BytesIO()
        torch.save(module.cpu().state_dict(), buffer)
        result["state"] = buffer.getvalue()
    return result
