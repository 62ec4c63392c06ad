"""The environment contract: every variable a worker receives, named and parsed in one place.

========================  ===========================================================================
variable                  meaning
========================  ===========================================================================
RANK, WORLD_SIZE          global rank and number of ranks (torch names)
LOCAL_RANK,               rank among the ranks on this host, and their number
LOCAL_WORLD_SIZE
GROUP_RANK,               index of this host among the job's hosts, and their number
GROUP_WORLD_SIZE
ROLE_RANK,                as RANK / WORLD_SIZE (torchrun sets them; some libraries read them)
ROLE_WORLD_SIZE
MASTER_ADDR, MASTER_PORT  the store the driver hosts; every rank connects as an authenticated client
TORCHELASTIC_RUN_ID       the job's id; Lightning detects a torchrun-style job by it
TORCHELASTIC_RESTART_*    restart count (0 unless elastic) and max restarts
TORCHELASTIC_USE_AGENT_   "True": env:// rendezvous connects to the driver's store instead of starting
STORE                     one on rank 0 (no free-port race)
HOROVOD_RANK, _SIZE,      Horovod's names for the same facts; CROSS_RANK / CROSS_SIZE group ranks with
HOROVOD_LOCAL_RANK, ...   the same local rank across hosts (Horovod's definition)
HOROVOD_HOSTNAME          the host the launcher placed this rank on
PHALANX_RUN_ID            the job's id
PHALANX_CHANNEL           host:port of the driver's channel (results, errors, logs)
PHALANX_SECRET            the per-job secret that authenticates this worker on the channel
PHALANX_START_TIMEOUT_S   seconds a worker may take to reach the channel
PHALANX_ELASTIC_WORKER_   elastic jobs: the worker's stable id (its torch rank comes from the store,
ID                        round by round; see docs/elastic.md)
PHALANX_ELASTIC_TIMEOUT_  elastic jobs: seconds to wait for the next round and for a collective (60)
S
PHALANX_ELASTIC_CHECKPOI  elastic jobs (user knob): commit() also writes the state to this directory
NT_DIR
PYTHONUNBUFFERED          "1" so that output streams line by line (a user's own value is kept)
========================  ===========================================================================
"""

from __future__ import annotations

from phalanx.env import elastic, names
from phalanx.env.contract import (
    DEFAULT_START_TIMEOUT_S,
    JobContract,
    RankIdentity,
    WorkerContract,
    assign_ranks,
    compose_env,
    read_contract,
    worker_env,
)

__all__ = [
    "DEFAULT_START_TIMEOUT_S",
    "JobContract",
    "RankIdentity",
    "WorkerContract",
    "assign_ranks",
    "compose_env",
    "elastic",
    "names",
    "read_contract",
    "worker_env",
]
