"""The elastic multi-host job: ``STEPS`` committed steps, each one allreduce of ones.

``python job_elastic.py STEPS HOLD GATE`` is a worker (run by ``phalanxrun``) whose 3 ranks wait after step HOLD
until the file GATE exists (the test kills a host's rank, then writes it); ``python job_elastic.py STEPS KEY
DISCOVERY HOLD`` is a driver running the same loop as a function, ``phalanx.run(train, hosts="hosta:2,hostb:1",
min_np=2, max_np=3, host_discovery_script=DISCOVERY)``, whose 3 ranks wait after step HOLD until a new world is
published (``check_host_updates()`` raises ``HostsUpdatedInterrupt``; the test changes the hosts then). Rank 0
prints ``STEP n size s`` after each commit; every rank of the final world prints one ``RESULT`` JSON line (a
worker) or the driver prints the list ``phalanx.run`` returned.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time
from typing import Any

#: Seconds the ranks hold for the test's change at most (generous: a loaded host); then they fail, naming it.
HOLD_S = 60.0


def train(steps: int, hold_after: int = 0, gate: str = "") -> dict[str, Any]:
    """The elastic loop; this rank's record in the final world: rank, size, host and the committed sums."""
    import torch

    import phalanx.torch as hvd

    hvd.init()
    state = hvd.elastic.ObjectState(step=0, total=0.0)

    @hvd.elastic.run
    def loop(state: hvd.elastic.ObjectState) -> None:
        while state.step < steps:
            # The sum over the world is its size: the total counts every (step, member) once, committed.
            state.total += float(hvd.allreduce(torch.ones(1), op=hvd.Sum).item())
            state.step += 1
            state.commit()
            if hvd.rank() == 0:
                print(f"STEP {state.step} size {hvd.size()}", flush=True)
            if state.step == hold_after and hvd.size() == 3:
                _hold(state.check_host_updates, gate)

    loop(state)
    record = {"rank": hvd.rank(), "size": hvd.size(), "host": socket.gethostname(), "step": state.step,
              "total": state.total}
    hvd.shutdown()
    return record


def _hold(check_host_updates: Any, gate: str) -> None:
    """Wait for the test's change: the gate file (when given), else a new world (``check_host_updates()``
    raises ``HostsUpdatedInterrupt``); fail after HOLD_S."""
    deadline = time.monotonic() + HOLD_S
    while not (gate and os.path.exists(gate)):
        if not gate:
            check_host_updates()
        if time.monotonic() > deadline:
            raise TimeoutError(f"the test's change did not come within {HOLD_S:g} s ({gate or 'a new world'})")
        time.sleep(0.05)


def drive(steps: int, key: str, discovery: str, hold_after: int) -> None:
    """Run :func:`train` as an elastic function job across the simulated hosts; print what it returned."""
    import phalanx

    out = phalanx.run(train, args=(steps, hold_after), np=3, hosts="hosta:2,hostb:1", min_np=2, max_np=3,
                      host_discovery_script=discovery, ssh_identity_file=key, start_timeout=60,
                      env={"PHALANX_ELASTIC_TIMEOUT_S": "30"})
    print("RESULT " + json.dumps(out), flush=True)


if __name__ == "__main__":
    if len(sys.argv) == 5:
        drive(int(sys.argv[1]), sys.argv[2], sys.argv[3], int(sys.argv[4]))
    else:
        print("RESULT " + json.dumps(train(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3])), flush=True)
