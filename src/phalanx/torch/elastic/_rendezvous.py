"""The worker side of an elastic round: wait for the driver's assignment, join that round's group.

The driver hosts the store and publishes each round (``phalanx.env.rounds``); a worker is a store
client. Each round's process group lives under its own key prefix, so a new round never reads the keys
of a broken one.
"""

from __future__ import annotations

import hashlib
import os
import socket
import time
from collections.abc import Mapping
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from phalanx.env import assign_ranks, settings
from phalanx.env import names as env_names
from phalanx.env import rounds as elastic_keys
from phalanx.errors import ElasticTimeoutError, WorkerContractError
from phalanx.job import store_client
from phalanx.torch._runtime import RUNTIME
from phalanx.transport import api as transport


def is_elastic(env: Mapping[str, str]) -> bool:
    """Whether this process is a worker of an elastic job."""
    return settings.ELASTIC_WORKER_ID.get(env) is not None


def timeout_s(env: Mapping[str, str] | None = None) -> float:
    """Seconds to wait for a round or a collective (``PHALANX_ELASTIC_TIMEOUT_S``, default 60).

    Raises:
        SettingError: the variable is not a positive number.
    """
    return settings.ELASTIC_TIMEOUT.get(env)


def _worker_id(env: Mapping[str, str]) -> int:
    worker = settings.ELASTIC_WORKER_ID.get(env)
    if worker is None:
        raise WorkerContractError(f"{env_names.PHALANX_ELASTIC_WORKER_ID} is not set: not an elastic worker")
    return worker


def _client(env: Mapping[str, str]) -> Any:
    if RUNTIME.round.store is None:
        RUNTIME.round.store = store_client.from_env(env, timedelta(seconds=timeout_s(env)))
    return RUNTIME.round.store


def wait_assignment(env: Mapping[str, str]) -> tuple[int, int, int]:
    """Wait for the first round after this process's current one; return (round, rank, size).

    Raises:
        ElasticTimeoutError: no new round within ``PHALANX_ELASTIC_TIMEOUT_S`` seconds.
        WorkerContractError: the driver left this worker out of the round.
    """
    store = _client(env)
    wait = timeout_s(env)
    try:
        store.wait([elastic_keys.round_key(RUNTIME.round.number + 1)], timedelta(seconds=wait))
    except (RuntimeError, dist.DistError) as e:
        raise ElasticTimeoutError(
            f"elastic worker {settings.ELASTIC_WORKER_ID.get(env)} waited {wait:g} s for round "
            f"{RUNTIME.round.number + 1} from the driver and none came; raise {env_names.PHALANX_ELASTIC_TIMEOUT_S} if "
            f"re-forming the world takes longer ({e})"
        ) from e
    latest = int(store.get(elastic_keys.LATEST_KEY))
    key = elastic_keys.assign_key(latest, _worker_id(env))
    if not store.check([key]):
        raise WorkerContractError(f"the driver left elastic worker {key.rsplit('/', 1)[-1]} out of round {latest}")
    rank, size = elastic_keys.decode_assignment(store.get(key))
    return latest, rank, size


def join(backend: str, env: Mapping[str, str]) -> dict[str, str]:
    """Join the next round's process group; return ``env`` with this round's topology laid over it.

    Raises:
        ElasticTimeoutError: no round came in time.
    """
    number, rank, size = wait_assignment(env)
    # Before the group forms: a round that fails to form (another loss meanwhile) is not waited for again.
    RUNTIME.round.number = number
    prefixed = dist.PrefixStore(elastic_keys.group_prefix(number), _client(env))
    transport.init_process_group(backend, store=prefixed, rank=rank, world_size=size,
                                 timeout=timedelta(seconds=timeout_s(env)))
    return {**env, **_topology_env(env, rank)}


def _host_key(env: Mapping[str, str]) -> int:
    host = settings.HOSTNAME.get(env) or socket.gethostname()
    return int.from_bytes(hashlib.blake2b(host.encode(), digest_size=7).digest(), "little")


def _topology_env(env: Mapping[str, str], rank: int) -> dict[str, str]:
    """This round's local and cross ranks: the members' hosts are gathered (a round mixes hosts on Spark)."""
    mine = torch.tensor([_host_key(env)], dtype=torch.int64)
    hosts = [torch.empty(1, dtype=torch.int64) for _ in range(dist.get_world_size())]
    dist.all_gather(hosts, mine)
    who = assign_ranks([str(int(h)) for h in hosts])[rank]
    return {env_names.HOROVOD_LOCAL_RANK: str(who.local_rank), env_names.HOROVOD_LOCAL_SIZE: str(who.local_size),
            env_names.HOROVOD_CROSS_RANK: str(who.cross_rank), env_names.HOROVOD_CROSS_SIZE: str(who.cross_size)}


def mark_synced(env: Mapping[str, str] | None = None) -> None:
    """Tell the driver this worker holds the job's state in the current round (no-op outside elastic jobs)."""
    env = os.environ if env is None else env
    if RUNTIME.round.store is not None and is_elastic(env):
        RUNTIME.round.store.set(elastic_keys.synced_key(RUNTIME.round.number, _worker_id(env)), "1")


def new_round_published(wait_s: float = 0.0) -> bool:
    """Whether the driver published a round after this process's current one.

    Args:
        wait_s: seconds to keep looking (0: look once).
    """
    if RUNTIME.round.store is None:
        return False
    give_up = time.monotonic() + wait_s
    while True:
        if RUNTIME.round.store.check([elastic_keys.round_key(RUNTIME.round.number + 1)]):
            return True
        if time.monotonic() >= give_up:
            return False
        time.sleep(0.05)
