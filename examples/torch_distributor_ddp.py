"""TorchDistributor with DDP: a training function, or a training script with its arguments.

The function (``ddp_train.train``) is plain torch.distributed code that reads ``RANK``, ``WORLD_SIZE`` and
``LOCAL_RANK`` from the environment, as under torchrun; phalanx's ``TorchDistributor`` (pyspark's API)
sets them on every rank:

    .venv/bin/python examples/torch_distributor_ddp.py                   # function, local mode (no Spark job)
    .venv/bin/python examples/torch_distributor_ddp.py --spark           # function, 2 Spark barrier tasks
    .venv/bin/python examples/torch_distributor_ddp.py --script          # .run("ddp_train.py", "--lr=0.01")
    .venv/bin/python examples/torch_distributor_ddp.py --script --spark

With ``--spark`` and no active SparkSession, phalanx starts an embedded ``local[*]`` one. Nothing is
downloaded.
"""

from __future__ import annotations

import argparse
import os
import re

from phalanx.spark import TorchDistributor

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(HERE, "ddp_train.py")


def run_function(num_processes: int = 2, local_mode: bool = True, epochs: int = 8, lr: float = 0.01) -> float:
    """``TorchDistributor(...).run(train, epochs, lr)``: rank 0's test accuracy."""
    from ddp_train import train

    distributor = TorchDistributor(num_processes=num_processes, local_mode=local_mode, use_gpu=False)
    return float(distributor.run(train, epochs, lr))


def run_script(num_processes: int = 2, local_mode: bool = True, epochs: int = 8, lr: float = 0.01) -> float:
    """``TorchDistributor(...).run("ddp_train.py", "--lr=0.01", ...)``: the accuracy rank 0 printed."""
    distributor = TorchDistributor(num_processes=num_processes, local_mode=local_mode, use_gpu=False)
    stdout: str = distributor.run(SCRIPT, f"--lr={lr}", f"--epochs={epochs}")  # rank 0's stdout
    found = re.search(r"test accuracy: ([0-9.]+)", stdout)
    if found is None:
        raise RuntimeError(f"rank 0 printed no test accuracy; its output was:\n{stdout}")
    return float(found.group(1))


def main(argv: list[str] | None = None) -> float:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-processes", type=int, default=2)
    parser.add_argument("--spark", action="store_true", help="one Spark barrier task per rank (local_mode=False)")
    parser.add_argument("--script", action="store_true", help="run ddp_train.py as a script instead of a function")
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--lr", type=float, default=0.01)
    args = parser.parse_args(argv)
    runner = run_script if args.script else run_function
    test_accuracy = runner(args.num_processes, not args.spark, args.epochs, args.lr)
    how = "script" if args.script else "function"
    where = "Spark barrier tasks" if args.spark else "local processes"
    print(f"test accuracy: {test_accuracy:.3f} (DDP {how}, {args.num_processes} {where})")
    return test_accuracy


if __name__ == "__main__":
    main()
