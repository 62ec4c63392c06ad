"""Other launchers' rank variables, read as the worker contract: Slurm's ``srun``, Open MPI's and MPICH's
``mpirun``.

``hvd.init()`` (and the ``phalanx_shm`` backend) read torch's names (``RANK``, ``WORLD_SIZE``,
``LOCAL_RANK``, ``MASTER_ADDR``...). A process started by phalanx or torchrun has them; one started by
``srun`` or ``mpirun`` has that launcher's instead. :func:`contract_from_foreign` translates them, pure:
environment in, the torch names out (empty when a phalanx/torchrun contract is present or no known launcher
started the process). The parent's environment is never modified.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from phalanx.env import names
from phalanx.errors import WorkerContractError

#: torch's default store port, used when ``MASTER_PORT`` is not given under mpirun.
DEFAULT_MASTER_PORT = 29500
#: Under Slurm without ``MASTER_PORT``: a port derived from the job id (the same on every node of a job).
SLURM_PORT_BASE = 15000
SLURM_PORT_SPAN = 20000

_RANGE = re.compile(r"^(\d+)(?:-(\d+))?$")


def expand_nodelist(nodelist: str) -> list[str]:
    """Expand a Slurm node list (``node[01-03,07],gpu1``) into host names, in order.

    Raises:
        WorkerContractError: a malformed list (the text is named).
    """
    out: list[str] = []
    for item in re.findall(r"[^,\[]+(?:\[[^\]]*\])?[^,]*", nodelist):
        match = re.fullmatch(r"([^\[]*)\[([^\]]*)\](.*)", item)
        if match is None:
            out.append(item)
            continue
        prefix, ranges, suffix = match.groups()
        for part in ranges.split(","):
            bounds = _RANGE.match(part)
            if bounds is None:
                raise WorkerContractError(f"{names.SLURM_JOB_NODELIST}={nodelist!r}: cannot read the range {part!r}")
            lo, hi = bounds.group(1), bounds.group(2) or bounds.group(1)
            out.extend(f"{prefix}{i:0{len(lo)}d}{suffix}" for i in range(int(lo), int(hi) + 1))
    if not out:
        raise WorkerContractError(f"{names.SLURM_JOB_NODELIST}={nodelist!r} names no node")
    return out


def tasks_per_node(text: str) -> list[int]:
    """Expand Slurm's ``SLURM_TASKS_PER_NODE`` (``2(x3),1``) into one count per node.

    Raises:
        WorkerContractError: a malformed value.
    """
    out: list[int] = []
    for part in text.split(","):
        match = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
        if match is None:
            raise WorkerContractError(f"{names.SLURM_TASKS_PER_NODE}={text!r} is not Slurm's 'N(xM),...' form")
        out.extend([int(match.group(1))] * int(match.group(2) or 1))
    return out


def _int(env: Mapping[str, str], name: str) -> int:
    raw = env.get(name, "")
    try:
        return int(raw)
    except ValueError as e:
        raise WorkerContractError(f"{name}={raw!r} is not an integer; fix the launcher's environment") from e


def _slurm(env: Mapping[str, str]) -> dict[str, str]:
    node = _int(env, names.SLURM_NODEID) if names.SLURM_NODEID in env else 0
    if names.SLURM_NTASKS_PER_NODE in env:
        local_size = _int(env, names.SLURM_NTASKS_PER_NODE)
    elif names.SLURM_TASKS_PER_NODE in env:
        local_size = tasks_per_node(env[names.SLURM_TASKS_PER_NODE])[node]
    else:
        local_size = _int(env, names.SLURM_NTASKS)
    out = {
        names.RANK: env[names.SLURM_PROCID], names.WORLD_SIZE: env[names.SLURM_NTASKS],
        names.LOCAL_RANK: env.get(names.SLURM_LOCALID, "0"), names.LOCAL_WORLD_SIZE: str(local_size),
        names.GROUP_RANK: str(node), names.GROUP_WORLD_SIZE: env.get(names.SLURM_NNODES, "1"),
    }
    if not env.get(names.MASTER_ADDR):
        if not env.get(names.SLURM_JOB_NODELIST):
            raise WorkerContractError(f"under srun, {names.SLURM_JOB_NODELIST} or {names.MASTER_ADDR} must be set")
        out[names.MASTER_ADDR] = expand_nodelist(env[names.SLURM_JOB_NODELIST])[0]
    if not env.get(names.MASTER_PORT):
        job = _int(env, names.SLURM_JOB_ID) if env.get(names.SLURM_JOB_ID) else 0
        out[names.MASTER_PORT] = str(SLURM_PORT_BASE + job % SLURM_PORT_SPAN)
    return out


def _mpi(env: Mapping[str, str], rank: str, size: str, local_rank: str, local_size: str,
         launcher: str) -> dict[str, str]:
    if not env.get(names.MASTER_ADDR):
        raise WorkerContractError(
            f"started by {launcher} ({rank} is set) but {names.MASTER_ADDR} is not: give every rank rank 0's host, "
            f"e.g. mpirun -x {names.MASTER_ADDR}=node1 -x {names.MASTER_PORT}={DEFAULT_MASTER_PORT} python train.py"
        )
    out = {names.RANK: env[rank], names.WORLD_SIZE: env[size]}
    if local_rank in env and local_size in env:
        out[names.LOCAL_RANK], out[names.LOCAL_WORLD_SIZE] = env[local_rank], env[local_size]
        local = max(1, _int(env, local_size))
        out[names.GROUP_RANK] = str(_int(env, rank) // local)
        out[names.GROUP_WORLD_SIZE] = str(max(1, _int(env, size) // local))
    if not env.get(names.MASTER_PORT):
        out[names.MASTER_PORT] = str(DEFAULT_MASTER_PORT)
    return out


def contract_from_foreign(env: Mapping[str, str]) -> dict[str, str]:
    """torch's contract variables translated from ``srun``'s or ``mpirun``'s, or ``{}``.

    Nothing is translated when ``RANK`` (phalanx, torchrun) or ``HOROVOD_RANK`` is already set.

    Raises:
        WorkerContractError: a known launcher's variables are malformed, or ``MASTER_ADDR`` is missing
            under mpirun (which has no notion of it).
    """
    if env.get(names.RANK) or env.get(names.HOROVOD_RANK):
        return {}
    if env.get(names.SLURM_PROCID) and env.get(names.SLURM_NTASKS):
        return _slurm(env)
    if env.get(names.OMPI_COMM_WORLD_RANK) and env.get(names.OMPI_COMM_WORLD_SIZE):
        return _mpi(env, names.OMPI_COMM_WORLD_RANK, names.OMPI_COMM_WORLD_SIZE, names.OMPI_COMM_WORLD_LOCAL_RANK,
                    names.OMPI_COMM_WORLD_LOCAL_SIZE, "Open MPI's mpirun")
    if env.get(names.PMI_RANK) and env.get(names.PMI_SIZE):
        return _mpi(env, names.PMI_RANK, names.PMI_SIZE, names.MPI_LOCALRANKID, names.MPI_LOCALNRANKS, "MPICH's mpirun")
    return {}
