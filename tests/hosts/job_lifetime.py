"""A rank of the multi-host failure tests. ``kill``: the last rank SIGKILLs itself after the first allreduce;
``train``: every rank prints READY after its first allreduce and keeps allreducing (a host is then killed);
``wait``: every rank prints READY, then sleeps (the test kills the driver or an ssh connection; these ranks
need no transport: what is tested is that every process ends)."""

from __future__ import annotations

import os
import signal
import sys
import time


def main() -> None:
    if sys.argv[1] == "kill":
        import torch

        import phalanx.torch as hvd

        hvd.init()
        hvd.allreduce(torch.ones(4))
        if hvd.rank() == hvd.size() - 1:
            os.kill(os.getpid(), signal.SIGKILL)
    if sys.argv[1] == "train":
        _train()
    print(f"READY {os.environ['HOROVOD_RANK']}", flush=True)
    time.sleep(600)  # under test: the ranks run until the test kills or stops the job


def _train() -> None:
    import torch

    import phalanx.torch as hvd

    hvd.init()
    hvd.allreduce(torch.ones(4), name="first")
    print(f"READY {hvd.rank()}", flush=True)
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        hvd.allreduce(torch.ones(1 << 12))
        time.sleep(0.01)  # a steady training job, until the test kills or stops it


if __name__ == "__main__":
    main()
