"""Same-host collectives through shared memory (see ``docs/shm.md``).

phalanx.torch routes its payload and control-block collectives through :mod:`._dispatch`, which uses a
group's shared-memory :class:`~._setup.Transport` when the group has one (ranks sharing a host, on by
default, ``PHALANX_SHM=0`` turns it off) and ``torch.distributed`` (gloo / NCCL) otherwise.
"""

from __future__ import annotations

from phalanx.torch.shm._dispatch import (
    Done,
    all_gather_single,
    all_reduce,
    all_reduce_many,
    broadcast,
    clear,
    early_claim,
    early_find,
    grad_barrier,
    overlaps,
    register,
)
from phalanx.torch.shm._setup import Transport, build, enabled

__all__ = ["Done", "Transport", "all_gather_single", "all_reduce", "all_reduce_many", "broadcast", "build", "clear",
           "early_claim", "early_find", "enabled", "grad_barrier", "overlaps", "register"]
