"""PyTorch Lightning under TorchDistributor: ``Trainer(strategy="ddp", devices=N)`` inside the function.

phalanx gives every rank torchrun's environment (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``,
``MASTER_ADDR``..., and ``TORCHELASTIC_RUN_ID``), so Lightning sees a torchrun-style job and joins it
instead of spawning processes of its own. ``devices`` must equal the ranks per host (``LOCAL_WORLD_SIZE``);
on CPU pass ``accelerator="cpu"`` (on GPUs: ``accelerator="gpu"`` and ``use_gpu=True``).

    .venv/bin/python examples/lightning_digits.py [--num-processes 2] [--epochs 8] [--spark]

Needs ``pip install lightning``. Trains a small CNN on scikit-learn's handwritten digits; nothing is
downloaded.
"""

from __future__ import annotations

import argparse
import os

from phalanx.spark import TorchDistributor


def train_lightning(epochs: int = 8, lr: float = 0.01, batch_size: int = 32) -> float:
    """Fit a LightningModule with the DDP strategy; return the test accuracy."""
    import lightning as L
    import torch
    import torch.nn.functional as F
    from _digits import accuracy, load_digits_split, make_model
    from torch.utils.data import DataLoader, TensorDataset

    class Digits(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = make_model()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.net(x)

        def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
            x, y = batch
            return F.cross_entropy(self.net(x), y)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.Adam(self.parameters(), lr=lr)

    L.seed_everything(0, verbose=False)
    x_tr, y_tr, x_te, y_te = load_digits_split()
    # Lightning adds the DistributedSampler under the DDP strategy (each rank trains on its own shard).
    loader = DataLoader(TensorDataset(x_tr, y_tr), batch_size=batch_size, shuffle=True)
    model = Digits()
    devices = int(os.environ["LOCAL_WORLD_SIZE"])  # ranks on this host: N for N local processes
    trainer = L.Trainer(
        strategy="ddp", accelerator="cpu", devices=devices, num_nodes=int(os.environ["WORLD_SIZE"]) // devices,
        max_epochs=epochs, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model, loader)
    return accuracy(model.eval(), x_te, y_te)


def main(argv: list[str] | None = None) -> float:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-processes", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--lr", type=float, default=0.01)
    parser.add_argument("--spark", action="store_true", help="one Spark barrier task per rank (local_mode=False)")
    args = parser.parse_args(argv)
    distributor = TorchDistributor(num_processes=args.num_processes, local_mode=not args.spark, use_gpu=False)
    test_accuracy = float(distributor.run(train_lightning, args.epochs, args.lr))
    print(f"test accuracy: {test_accuracy:.3f} (Lightning DDP, {args.num_processes} ranks)")
    return test_accuracy


if __name__ == "__main__":
    main()
