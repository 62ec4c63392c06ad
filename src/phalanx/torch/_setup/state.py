"""Process-wide state of ``phalanx.torch``: the process group, this rank's topology, the init guard.

``init()`` joins (or creates) the default ``torch.distributed`` process group:

* under a phalanx launcher or ``torchrun`` (``MASTER_ADDR`` is set): ``env://`` rendezvous;
* when the user already called ``dist.init_process_group`` (Lightning, a notebook): that group is reused;
* with no launcher at all: a one-rank group on a private in-process ``HashStore`` (no port is opened).
"""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping
from datetime import timedelta

import torch
import torch.distributed as dist

from phalanx.env import RankIdentity, settings
from phalanx.env import names as env_names
from phalanx.env.foreign import contract_from_foreign
from phalanx.errors import NotInitializedError
from phalanx.torch._health import generations as _generations
from phalanx.torch._runtime import RUNTIME
from phalanx.transport import api as transport


def topology_from_env(env: Mapping[str, str], rank: int, size: int) -> RankIdentity:
    """Derive the local/cross topology of ``rank`` from launcher variables.

    Args:
        env: the environment (phalanx launchers set the Horovod names; torchrun sets LOCAL_* and GROUP_*).
        rank: this process's global rank (from the process group).
        size: the number of ranks.

    Returns:
        Who this rank is; a single host is assumed when nothing says otherwise, and the host's index and
        count are the cross rank and size unless torch's ``GROUP_*`` names say otherwise.
    """
    first_int = settings.first_int
    local_size = first_int(env, env_names.HOROVOD_LOCAL_SIZE, env_names.LOCAL_WORLD_SIZE, default=size)
    local_rank = first_int(env, env_names.HOROVOD_LOCAL_RANK, env_names.LOCAL_RANK, default=rank % max(local_size, 1))
    cross_size = first_int(env, env_names.HOROVOD_CROSS_SIZE, env_names.GROUP_WORLD_SIZE,
                           default=max(size // local_size, 1))
    cross_rank = first_int(env, env_names.HOROVOD_CROSS_RANK, env_names.GROUP_RANK, default=rank // max(local_size, 1))
    host_rank = first_int(env, env_names.GROUP_RANK, default=cross_rank)
    host_count = first_int(env, env_names.GROUP_WORLD_SIZE, default=cross_size)
    hostname = settings.HOSTNAME.get(env) or socket.gethostname()
    return RankIdentity(rank, size, local_rank, local_size, cross_rank, cross_size, host_rank, host_count, hostname)


def _backend() -> str:
    if torch.cuda.is_available() and dist.is_nccl_available():
        return "cpu:gloo,cuda:nccl"
    return "gloo"


def _rank_and_size(env: Mapping[str, str]) -> tuple[int, int]:
    rank = settings.first_int(env, env_names.RANK, env_names.HOROVOD_RANK, default=0)
    size = settings.first_int(env, env_names.WORLD_SIZE, env_names.HOROVOD_SIZE, default=1)
    return rank, size


def join_process_group(env: Mapping[str, str] | None = None) -> None:
    """Join or create the default process group (see the module docstring); idempotent.

    Args:
        env: the environment to read; ``os.environ`` when None.

    Raises:
        ValueError: the launcher variables are malformed.
    """
    env = os.environ if env is None else env
    foreign = contract_from_foreign(env)  # srun / mpirun: their rank variables as torch's
    if foreign:
        os.environ.update(foreign)  # env:// and the shm transport read these names from the process
        env = {**env, **foreign}
    backend = _backend()
    RUNTIME.process.cuda_backend = "nccl" in backend
    if dist.is_initialized():
        RUNTIME.process.owns_group = False
        RUNTIME.process.cuda_backend = "nccl" in str(dist.get_backend())
    elif settings.ELASTIC_WORKER_ID.get(env) is not None:
        from phalanx.torch.elastic import _rendezvous  # only elastic jobs pay for it

        env = _rendezvous.join(backend, env)
        RUNTIME.process.owns_group = True
    elif RUNTIME.job.store is not None:  # init again after shutdown (see _health.generations)
        _generations.rejoin(backend, *_rank_and_size(env), gloo_timeout(env))
        RUNTIME.process.owns_group = True
    elif env.get(env_names.MASTER_ADDR):
        rank, size = _rank_and_size(env)
        transport.init_process_group(backend, init_method="env://", rank=rank, world_size=size,
                                     timeout=gloo_timeout(env))
        _generations.first(rank)
        RUNTIME.process.owns_group = True
    else:
        # No launcher: one rank on a private in-process store (no TCP port, so no port race).
        transport.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
        RUNTIME.process.owns_group = True
    RUNTIME.process.topology = topology_from_env(env, dist.get_rank(), dist.get_world_size())
    _share_cores(env, RUNTIME.process.topology)


def gloo_timeout(env: Mapping[str, str]) -> timedelta | None:
    """``HOROVOD_GLOO_TIMEOUT_SECONDS`` (``phalanxrun --gloo-timeout-seconds``) as the default group's
    timeout, or None (torch's default) when unset.

    Raises:
        ValueError: not a positive number of seconds.
    """
    seconds = settings.GLOO_TIMEOUT.get(env)
    return None if seconds is None else timedelta(seconds=seconds)


def _share_cores(env: Mapping[str, str], topo: RankIdentity) -> None:
    """Give each local rank its share of the cores, as torchrun does, unless the user chose a number.

    N ranks on a host each running torch's default one-thread-per-core OpenMP pool oversubscribe the
    CPU; OpenMP's spinning barriers then make a 1 MB copy take milliseconds instead of 0.1 ms.
    """
    if env.get(env_names.OMP_NUM_THREADS) or topo.local_size <= 1:
        return
    share = max(1, (os.cpu_count() or 1) // topo.local_size)
    if torch.get_num_threads() > share:
        torch.set_num_threads(share)


def leave_process_group() -> None:
    """Destroy the default process group if ``init()`` created it (the topology is forgotten by
    ``RUNTIME.reset()``)."""
    if RUNTIME.process.owns_group and dist.is_initialized():
        dist.destroy_process_group()


def topology() -> RankIdentity:
    """This rank's topology.

    Raises:
        NotInitializedError: ``hvd.init()`` has not been called.
    """
    topo = RUNTIME.process.topology
    if topo is None:
        raise NotInitializedError(
            "phalanx.torch has not been initialized; call hvd.init() (import phalanx.torch as hvd) "
            "before any other hvd function"
        )
    return topo
