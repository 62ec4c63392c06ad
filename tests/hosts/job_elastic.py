"""A worker of the elastic multi-host test: ``STEPS`` committed steps, each one allreduce of ones.

Rank 0 prints ``STEP n size s`` after each commit (the test kills a host once it saw enough steps); every
rank of the final world prints one ``RESULT`` JSON line: its rank, size, host and the committed sums.
"""

from __future__ import annotations

import json
import socket
import sys
import time

import torch

import phalanx.torch as hvd

STEPS = int(sys.argv[1]) if len(sys.argv) > 1 else 30


def main() -> None:
    hvd.init()
    state = hvd.elastic.ObjectState(step=0, total=0.0)

    @hvd.elastic.run
    def loop(state: hvd.elastic.ObjectState) -> None:
        while state.step < STEPS:
            # The sum over the world is its size: the total counts every (step, member) once, committed.
            state.total += float(hvd.allreduce(torch.ones(1), op=hvd.Sum).item())
            state.step += 1
            state.commit()
            if hvd.rank() == 0:
                print(f"STEP {state.step} size {hvd.size()}", flush=True)
            time.sleep(0.1)

    loop(state)
    print("RESULT " + json.dumps({"rank": hvd.rank(), "size": hvd.size(), "host": socket.gethostname(),
                                  "step": state.step, "total": state.total}), flush=True)
    hvd.shutdown()


if __name__ == "__main__":
    main()
