"""DeepSpeed ZeRO under DeepspeedTorchDistributor (pyspark's API), on CPU with gloo: nothing to install on the
cluster but phalanx and DeepSpeed, no ssh keys, no pdsh.

The training function is plain DeepSpeed: ``deepspeed.add_config_arguments`` parses the flags the distributor
passes as pyspark's does (``--deepspeed --deepspeed_config PATH`` in ``sys.argv``) and
``deepspeed.initialize(args=...)`` reads the config from them:

    .venv/bin/python examples/deepspeed_digits.py [--num-gpus 2] [--epochs 3] [--zero-stage 2] [--spark]

Trains a small CNN on scikit-learn's handwritten digits; nothing is downloaded.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from phalanx.spark import DeepspeedTorchDistributor


def ds_config(zero_stage: int, lr: float, micro_batch: int = 32) -> dict[str, Any]:
    """A DeepSpeed config for CPU: ZeRO ``zero_stage``, torch's Adam (no compiled op needed)."""
    return {
        "train_micro_batch_size_per_gpu": micro_batch,
        "optimizer": {"type": "Adam", "params": {"lr": lr, "torch_adam": True}},
        "zero_optimization": {"stage": zero_stage},
        "steps_per_print": 10**6,
    }


def train_deepspeed(epochs: int = 3) -> float:
    """Train with DeepSpeed on this rank; return the test accuracy (the same on every rank)."""
    import argparse as ap

    import deepspeed
    import torch
    import torch.nn.functional as F
    from _digits import load_digits_split, make_model
    from torch.utils.data import DistributedSampler, TensorDataset

    # DeepSpeed's own flags (--deepspeed, --deepspeed_config), which the distributor passes as pyspark's does
    flags, _ = deepspeed.add_config_arguments(ap.ArgumentParser()).parse_known_args(sys.argv[1:])
    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(0)
    x_tr, y_tr, x_te, y_te = load_digits_split()
    model = make_model()
    data = TensorDataset(x_tr, y_tr)
    engine, _, loader, _ = deepspeed.initialize(args=flags, model=model, model_parameters=model.parameters(),
                                                training_data=data)
    sampler = loader.data_sampler
    for epoch in range(epochs):
        if isinstance(sampler, DistributedSampler):
            sampler.set_epoch(epoch)
        for xb, yb in loader:
            loss = F.cross_entropy(engine(xb), yb)
            engine.backward(loss)
            engine.step()
    engine.eval()
    with torch.no_grad():
        test_accuracy = float((engine(x_te).argmax(1) == y_te).float().mean())
    engine.destroy()
    return test_accuracy


def main(argv: list[str] | None = None) -> float:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-gpus", type=int, default=2, help="ranks per node (numGpus; CPU ranks here)")
    parser.add_argument("--nnodes", type=int, default=1)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--lr", type=float, default=0.002)
    parser.add_argument("--zero-stage", type=int, default=2, choices=(0, 1, 2, 3))
    parser.add_argument("--spark", action="store_true", help="one Spark barrier task per rank (localMode=False)")
    args = parser.parse_args(argv)
    distributor = DeepspeedTorchDistributor(numGpus=args.num_gpus, nnodes=args.nnodes, localMode=not args.spark,
                                            useGpu=False, deepspeedConfig=ds_config(args.zero_stage, args.lr))
    test_accuracy = float(distributor.run(train_deepspeed, args.epochs))
    ranks = args.num_gpus * args.nnodes
    print(f"test accuracy: {test_accuracy:.3f} (DeepSpeed ZeRO-{args.zero_stage}, {ranks} ranks)")
    return test_accuracy


if __name__ == "__main__":
    main()
