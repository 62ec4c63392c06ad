"""A rank of the multi-host failure tests. ``kill``: rank 3 SIGKILLs itself after the first allreduce;
``wait``: every rank prints READY after the first allreduce, then sleeps (the test kills the driver)."""

from __future__ import annotations

import os
import signal
import sys
import time

import torch

import phalanx.torch as hvd


def main() -> None:
    hvd.init()
    hvd.allreduce(torch.ones(4))
    print(f"READY {hvd.rank()}", flush=True)
    if sys.argv[1] == "kill" and hvd.rank() == 3:
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(600)


if __name__ == "__main__":
    main()
