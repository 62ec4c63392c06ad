"""PyTorch Lightning with the Horovod strategy: ``Trainer(strategy="horovod")``, as in Horovod's Lightning guide.

The training code imports Lightning, not phalanx: inside a phalanx job ``"horovod"`` is a registered strategy
(elsewhere, ``import phalanx.lightning`` registers it). Lightning gives each rank its shard of the data
(``DistributedSampler``), averages the validation metrics over the ranks (``self.log(..., sync_dist=True)``),
and rank 0 writes the checkpoint. As with Horovod, the learning rate is multiplied by the number of ranks.

    phalanxrun -np 2 .venv/bin/python examples/lightning_horovod_digits.py [--epochs 4]
    .venv/bin/python examples/lightning_horovod_digits.py --launcher horovodrunner [--np 2 | --np -2]
    .venv/bin/python examples/lightning_horovod_digits.py --launcher distributor [--script] [--spark]
    .venv/bin/python examples/lightning_horovod_digits.py --launcher spark-run

``--flavour pytorch_lightning`` uses the standalone package instead of ``lightning``. Trains a small CNN on
scikit-learn's handwritten digits; nothing is downloaded.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib
import os
import re
import sys
import tempfile
from typing import Any

FLAVOURS = {"lightning": "lightning.pytorch", "pytorch_lightning": "pytorch_lightning"}


def _module_class(pl: Any, lr: float) -> Any:
    import torch
    import torch.nn.functional as F
    from _digits import make_model

    class Digits(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = make_model()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.net(x)

        def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
            loss = F.cross_entropy(self.net(batch[0]), batch[1])
            self.log("train_loss", loss)
            return loss

        def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
            logits = self.net(batch[0])
            self.log("val_loss", F.cross_entropy(logits, batch[1]), sync_dist=True)  # mean over ranks
            self.log("val_acc", (logits.argmax(1) == batch[1]).float().mean(), sync_dist=True)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.Adam(self.parameters(), lr=lr)  # HorovodStrategy multiplies it by the ranks

    return Digits


def _weights_agree(trainer: Any, model: Any) -> bool:
    """Whether every rank holds bit-identical weights (their digests gathered through the strategy)."""
    import torch

    digest = hashlib.sha256(b"".join(p.detach().cpu().numpy().tobytes() for p in model.parameters())).digest()
    every = trainer.strategy.all_gather(torch.frombuffer(bytearray(digest), dtype=torch.int64))
    return bool((every == every[0]).all())


def _private_dir() -> str:
    """A fresh directory of this user's only (``mkdtemp``: a random name, mode 0700), never a fixed name in the
    shared temporary directory, where another user could plant a link or an earlier run leave a checkpoint."""
    return tempfile.mkdtemp(prefix="lightning-horovod-ckpt-")


def train(epochs: int = 4, lr: float = 0.005, batch_size: int = 32, flavour: str = "lightning",
          ckpt_dir: str | None = None) -> dict[str, Any]:
    """What every rank runs: fit with ``strategy="horovod"``; rank 0 writes ``ckpt_dir/digits.ckpt``.

    Without ``ckpt_dir`` rank 0 makes a private directory; Lightning's ``ModelCheckpoint`` hands rank 0's
    directory to every rank when the fit starts, so the others make none.
    """
    from _digits import accuracy, load_digits_split
    from torch.utils.data import DataLoader, TensorDataset

    pl: Any = importlib.import_module(FLAVOURS[flavour])
    pl.seed_everything(0, verbose=False)
    x_tr, y_tr, x_te, y_te = load_digits_split()
    train_loader = DataLoader(TensorDataset(x_tr, y_tr), batch_size=batch_size, shuffle=True)
    val_loader = DataLoader(TensorDataset(x_te, y_te), batch_size=batch_size)
    model = _module_class(pl, lr)()
    if ckpt_dir is None and int(os.environ.get("RANK", "0")) == 0:
        ckpt_dir = _private_dir()
    checkpoint = pl.callbacks.ModelCheckpoint(dirpath=ckpt_dir, filename="digits", monitor="val_acc", mode="max")
    trainer = pl.Trainer(
        strategy="horovod", max_epochs=epochs, callbacks=[checkpoint], logger=False, enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model, train_loader, val_loader)
    return {
        "rank": trainer.global_rank, "size": trainer.world_size, "accuracy": accuracy(model.cpu().eval(), x_te, y_te),
        "val_acc": float(trainer.callback_metrics["val_acc"]), "checkpoint": checkpoint.best_model_path,
        "weights_agree": _weights_agree(trainer, model), "strategy": type(trainer.strategy).__module__,
    }


def _summary(result: dict[str, Any]) -> str:
    return (f"test accuracy: {result['accuracy']:.3f}; synced validation accuracy: {result['val_acc']:.3f}; "
            f"weights identical on {result['size']} ranks: {result['weights_agree']}; "
            f"checkpoint: {result['checkpoint']}")


def _parse_summary(text: str) -> dict[str, Any]:
    found = re.search(r"test accuracy: ([0-9.]+); synced validation accuracy: ([0-9.]+); weights identical on "
                      r"(\d+) ranks: (True|False); checkpoint: (\S*)", text)
    if found is None:
        raise RuntimeError(f"rank 0 printed no summary; its output was:\n{text[-3000:]}")
    return {"accuracy": float(found[1]), "val_acc": float(found[2]), "size": int(found[3]),
            "weights_agree": found[4] == "True", "checkpoint": found[5]}


def launch(args: argparse.Namespace) -> dict[str, Any]:
    """Run :func:`train` on ``args.np`` ranks with the launcher named by ``args.launcher``; rank 0's result."""
    ckpt_dir = os.path.abspath(args.ckpt_dir) if args.ckpt_dir else _private_dir()
    kwargs = {"epochs": args.epochs, "flavour": args.flavour, "ckpt_dir": ckpt_dir}
    if args.launcher == "horovodrunner":
        from phalanx.spark import HorovodRunner  # or: from sparkdl import HorovodRunner

        return dict(HorovodRunner(np=args.np).run(train, **kwargs))
    if args.launcher == "spark-run":
        import phalanx.spark  # or: import horovod.spark

        return dict(phalanx.spark.run(train, kwargs=kwargs, num_proc=args.np)[0])
    from phalanx.spark import TorchDistributor  # or: from pyspark.ml.torch.distributor import TorchDistributor

    distributor = TorchDistributor(num_processes=args.np, local_mode=not args.spark, use_gpu=False)
    if not args.script:
        return dict(distributor.run(train, **kwargs))
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in kwargs.items()]
    return _parse_summary(str(distributor.run(os.path.abspath(__file__), *flags)))  # rank 0's stdout


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--launcher", choices=["none", "horovodrunner", "distributor", "spark-run"], default="none",
                        help="none: this process is a rank (phalanxrun, a TorchDistributor script)")
    parser.add_argument("--np", type=int, default=2, help="ranks (HorovodRunner: -N on the driver, without Spark)")
    parser.add_argument("--script", action="store_true", help="distributor: run this file as a script")
    parser.add_argument("--spark", action="store_true", help="distributor: local_mode=False (Spark tasks)")
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--flavour", choices=sorted(FLAVOURS), default="lightning")
    parser.add_argument("--ckpt-dir", default=None,
                        help="where rank 0 writes digits.ckpt (default: a new private directory in the temporary "
                             "directory, printed at the end)")
    args = parser.parse_args(argv)
    if args.launcher == "none":
        result = train(args.epochs, flavour=args.flavour, ckpt_dir=args.ckpt_dir)
        if result["rank"] == 0:
            print(_summary(result), flush=True)
        return result
    result = launch(args)
    print(_summary(result))
    return result


if __name__ == "__main__":
    sys.exit(0 if main()["accuracy"] > 0.8 else 1)
