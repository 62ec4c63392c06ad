"""``Trainer(strategy="horovod")`` on 2 real ranks (phalanx.run), with no ``import phalanx.lightning`` in the
job: the worker entry's hook registers it. One job checks what a fit must guarantee; another, the failure."""

from __future__ import annotations

import importlib
import os
from pathlib import Path
from typing import Any

import pytest

import phalanx
from phalanx.errors import WorkerFailedError

pytestmark = [pytest.mark.multiprocess]

SAMPLES, BATCH, EPOCHS, ACCUMULATE, LR = 64, 8, 2, 2, 0.1


def _data() -> Any:
    import torch
    from torch.utils.data import TensorDataset

    x = torch.randn(SAMPLES, 4, generator=torch.Generator().manual_seed(0))
    return TensorDataset(x, (x.sum(1) > 0).long())


def _net(seed: int) -> Any:
    import torch

    torch.manual_seed(seed)  # a different start on each rank: only rank 0's broadcast makes them agree
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))


def _module(pl: Any, rank: int, fail_at: int | None = None) -> Any:
    import torch.nn.functional as F
    from torch import optim

    class Net(pl.LightningModule):  # type: ignore[misc,name-defined]
        def __init__(self) -> None:
            super().__init__()
            self.net = _net(rank)

        def training_step(self, batch: Any, batch_idx: int) -> Any:
            if fail_at is not None and self.global_rank == 1 and batch_idx == fail_at:
                raise RuntimeError("rank 1 fails in training_step")
            return F.cross_entropy(self.net(batch[0]), batch[1])

        def validation_step(self, batch: Any, batch_idx: int) -> None:
            loss = F.cross_entropy(self.net(batch[0]), batch[1])
            self.log("val_loss", loss, sync_dist=True)
            self.log("val_loss_local", loss)
            self.log("val_samples", float(len(batch[0])), sync_dist=True, reduce_fx="sum")

        def configure_optimizers(self) -> Any:
            return optim.SGD(self.parameters(), lr=LR)

    return Net()


def _recording_io(pl: Any) -> Any:
    class Recording(pl.plugins.TorchCheckpointIO):  # type: ignore[misc,name-defined]
        saves = 0

        def save_checkpoint(self, *args: Any, **kwargs: Any) -> None:
            Recording.saves += 1
            super().save_checkpoint(*args, **kwargs)

    return Recording()


def _plain_phalanx_twin(rank: int) -> list[float]:
    """What Lightning's accumulate_grad_batches=2 must equal: hvd with backward_passes_per_step=2, by hand."""
    import torch.nn.functional as F
    from torch import optim
    from torch.utils.data import DataLoader, DistributedSampler

    import phalanx.torch as hvd

    net = _net(rank)
    hvd.broadcast_parameters(net.state_dict(), root_rank=0)
    sgd = optim.SGD(net.parameters(), lr=LR * hvd.size())
    opt = hvd.DistributedOptimizer(sgd, named_parameters=net.named_parameters(), backward_passes_per_step=ACCUMULATE)
    # Lightning's injected sampler for training: shuffled, seed 0 (PL_GLOBAL_SEED unset), a new epoch each epoch.
    sampler: Any = DistributedSampler(_data(), num_replicas=hvd.size(), rank=hvd.rank(), shuffle=True, seed=0)
    for epoch in range(EPOCHS):
        sampler.set_epoch(epoch)
        for i, (x, y) in enumerate(DataLoader(_data(), batch_size=BATCH, sampler=sampler)):
            (F.cross_entropy(net(x), y) / ACCUMULATE).backward()
            if i % ACCUMULATE == ACCUMULATE - 1:
                opt.step()
                opt.zero_grad()
    return [float(v) for p in net.parameters() for v in p.detach().flatten()]


def _fit_job(flavour: str, ckpt_dir: str) -> dict[str, Any]:
    from torch.utils.data import DataLoader

    pl = importlib.import_module(flavour)
    rank = int(os.environ["RANK"])
    model, io = _module(pl, rank), _recording_io(pl)
    trainer = pl.Trainer(
        strategy="horovod", accelerator="cpu", max_epochs=EPOCHS, accumulate_grad_batches=ACCUMULATE,
        plugins=[io], callbacks=[pl.callbacks.ModelCheckpoint(dirpath=ckpt_dir, filename="last")],
        logger=False, enable_progress_bar=False, enable_model_summary=False,
    )
    trainer.fit(model, DataLoader(_data(), batch_size=BATCH), DataLoader(_data(), batch_size=BATCH))
    metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
    return {
        "rank": trainer.global_rank, "strategy": type(trainer.strategy).__module__, "metrics": metrics,
        "weights": [float(v) for p in model.net.parameters() for v in p.detach().flatten()],
        "twin": _plain_phalanx_twin(rank), "saves": type(io).saves, "steps": trainer.global_step,
    }


@pytest.mark.timeout(240)  # two ranks importing Lightning: ~8 s of CPU each
@pytest.mark.parametrize("flavour", ["pytorch_lightning"])
def test_fit_syncs_metrics_weights_and_accumulation(flavour: str, tmp_path: Path) -> None:
    pytest.importorskip(flavour)
    ranks = phalanx.run(_fit_job, args=(flavour, str(tmp_path)), np=2)
    assert [r["strategy"] for r in ranks] == ["phalanx.lightning.strategy"] * 2
    # self.log(sync_dist=True): the mean over ranks of each rank's own epoch mean; reduce_fx="sum" sums ranks.
    local = [r["metrics"]["val_loss_local"] for r in ranks]
    assert local[0] != local[1]  # each rank validated its own shard
    for r in ranks:
        assert r["metrics"]["val_loss"] == pytest.approx(sum(local) / 2, rel=1e-6)
        assert r["metrics"]["val_samples"] == SAMPLES
    assert ranks[0]["weights"] == ranks[1]["weights"]  # identical on every rank after fit
    assert ranks[0]["steps"] == EPOCHS * SAMPLES // 2 // BATCH // ACCUMULATE
    for r in ranks:  # accumulate_grad_batches=2 == backward_passes_per_step=2 (lr x size, as Horovod)
        assert r["weights"] == pytest.approx(r["twin"], rel=1e-6, abs=1e-7)
    assert [r["saves"] for r in ranks] == [EPOCHS, 0]  # one checkpoint per epoch, by rank 0 only
    assert (tmp_path / "last.ckpt").is_file()


def _failing_job() -> None:
    from torch.utils.data import DataLoader

    pl = importlib.import_module("lightning.pytorch")
    trainer = pl.Trainer(strategy="horovod", accelerator="cpu", max_epochs=1, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    model = _module(pl, int(os.environ["RANK"]), fail_at=2)
    trainer.fit(model, DataLoader(_data(), batch_size=BATCH))


@pytest.mark.timeout(180)
def test_a_rank_raising_in_training_step_is_the_root_cause() -> None:
    pytest.importorskip("lightning")
    with pytest.raises(WorkerFailedError) as info:
        phalanx.run(_failing_job, np=2)
    cause = info.value.root_cause
    assert cause.rank == 1
    assert cause.summary == "RuntimeError: rank 1 fails in training_step"
    assert "in training_step" in cause.traceback
