"""A rank of the multi-host collectives test: prints one JSON line with its layout and every result.

Sets: the global set (2 hosts x 2 ranks: the hierarchical path), ``{0, 1}`` (both on the first host: shared
memory) and ``{0, 2}`` (one rank per host: gloo alone). With ``quick``: the global set only (any size).
With ``wait``: then print ``READY`` and sleep (the test stops the job).
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time
from typing import Any

import torch

import phalanx.torch as hvd

# white-box: the transport's machine identity (no public name)
from phalanx.transport._setup import _machine_id


def collectives(ps: Any, members: list[int], n: int) -> dict[str, Any]:
    me = members.index(hvd.rank())
    small = hvd.allreduce(torch.full((1000,), float(hvd.rank() + 1)), op=hvd.Sum, process_set=ps)
    big = hvd.allreduce(torch.full((1 << 20,), float(hvd.rank() + 1)), op=hvd.Average, process_set=ps)
    gathered = hvd.allgather(torch.tensor([[hvd.rank(), hvd.rank() * 2]]), process_set=ps)
    bcast = hvd.broadcast(torch.tensor([float(hvd.rank()) * 10.0] * 3), root_rank=members[-1], process_set=ps)
    scattered = hvd.reducescatter(torch.arange(2.0 * len(members)) + hvd.rank(), op=hvd.Sum, process_set=ps)
    a2a = hvd.alltoall(torch.tensor([float(hvd.rank() * 100 + j) for j in range(len(members))]), process_set=ps)
    return {"me": me, "small": sorted(set(small.tolist())), "big": sorted(set(big.tolist())),
            "gathered": gathered.tolist(), "bcast": bcast.tolist(), "scattered": scattered.tolist(),
            "a2a": a2a.tolist()}


def parent() -> dict[str, Any]:
    """This rank's parent: a host's warm-start template forks its ranks (one import of torch per host)."""
    with open(f"/proc/{os.getppid()}/cmdline", "rb") as f:
        return {"pid": os.getppid(), "cmdline": f.read().replace(b"\0", b" ").decode()}


def main() -> None:
    full = "quick" not in sys.argv[1:]
    local_set, cross_set = hvd.ProcessSet([0, 1]), hvd.ProcessSet([0, 2])
    hvd.init(process_sets=[local_set, cross_set] if full else None)
    members = list(range(hvd.size()))
    out: dict[str, Any] = {
        "rank": hvd.rank(), "size": hvd.size(), "local_rank": hvd.local_rank(), "local_size": hvd.local_size(),
        "cross_rank": hvd.cross_rank(), "cross_size": hvd.cross_size(), "host": socket.gethostname(),
        "machine": _machine_id(), "parent": parent(),
        "global": collectives(hvd.global_process_set, members, len(members)),
    }
    if full and hvd.rank() in (0, 1):
        out["local"] = collectives(local_set, [0, 1], 2)
    if full and hvd.rank() in (0, 2):
        out["cross"] = collectives(cross_set, [0, 2], 2)
    print("RESULT " + json.dumps(out), flush=True)
    if "wait" in sys.argv[1:]:
        print(f"READY {hvd.rank()}", flush=True)
        time.sleep(600)  # under test: the ranks run until the test stops the job
    hvd.shutdown()


if __name__ == "__main__":
    main()
