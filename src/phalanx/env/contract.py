"""The worker contract: who a rank is and where the job meets, as environment variables.

Launchers call :func:`assign_ranks` (pure: hosts in rank order -> identities) and :func:`worker_env`
(pure: job + identity -> ``dict[str, str]``); workers call :func:`read_contract`. The parent's
``os.environ`` is never mutated.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from phalanx.env import names as env_names
from phalanx.env.settings import DEFAULT_START_TIMEOUT_S, START_TIMEOUT, TEARDOWN_GRACE
from phalanx.errors import WorkerContractError


@dataclass(frozen=True)
class RankIdentity:
    """Who one rank is, by Horovod's definitions.

    Attributes:
        rank: global rank, 0..size-1.
        size: number of ranks in the job.
        local_rank: index of this rank among the ranks on its host.
        local_size: number of ranks on this rank's host.
        cross_rank: index of this rank among the ranks with the same ``local_rank`` (host order).
        cross_size: number of ranks with the same ``local_rank``.
        host_rank: index of this rank's host among the job's hosts (torch's GROUP_RANK).
        host_count: number of hosts (torch's GROUP_WORLD_SIZE).
        hostname: the host this rank runs on, as the launcher named it.
    """

    rank: int
    size: int
    local_rank: int
    local_size: int
    cross_rank: int
    cross_size: int
    host_rank: int
    host_count: int
    hostname: str


@dataclass(frozen=True)
class JobContract:
    """Where a job meets: the same for every rank.

    Attributes:
        run_id: unique id of this job (also ``TORCHELASTIC_RUN_ID``).
        master_addr: host of the job's rendezvous store.
        master_port: port of the store.
        channel: ``host:port`` of the driver's channel.
        secret: hex per-job secret that authenticates workers on the channel.
        start_timeout_s: seconds a rank may take to start and reach the channel.
        restart_count: how many times the world has been re-formed (elastic); 0 for a plain job.
    """

    run_id: str
    master_addr: str
    master_port: int
    channel: str
    secret: str
    start_timeout_s: float = DEFAULT_START_TIMEOUT_S
    restart_count: int = 0


def assign_ranks(hosts: Sequence[str]) -> list[RankIdentity]:
    """Compute every rank's identity from the host each rank runs on.

    Args:
        hosts: ``hosts[r]`` is the host of rank ``r``. Ranks of one host need not be contiguous.

    Returns:
        One :class:`RankIdentity` per rank, in rank order. Hosts are ordered by their first rank.
    """
    host_order: list[str] = list(dict.fromkeys(hosts))
    local_rank: list[int] = []
    per_host: dict[str, int] = {}
    for host in hosts:
        local_rank.append(per_host.get(host, 0))
        per_host[host] = local_rank[-1] + 1
    per_local: dict[int, int] = {}
    cross_rank: list[int] = []
    for lr in local_rank:
        cross_rank.append(per_local.get(lr, 0))
        per_local[lr] = cross_rank[-1] + 1
    return [
        RankIdentity(
            rank=r,
            size=len(hosts),
            local_rank=local_rank[r],
            local_size=per_host[host],
            cross_rank=cross_rank[r],
            cross_size=per_local[local_rank[r]],
            host_rank=host_order.index(host),
            host_count=len(host_order),
            hostname=host,
        )
        for r, host in enumerate(hosts)
    ]


def _torch_vars(job: JobContract, who: RankIdentity) -> dict[str, str]:
    return {
        env_names.RANK: str(who.rank),
        env_names.WORLD_SIZE: str(who.size),
        env_names.LOCAL_RANK: str(who.local_rank),
        env_names.LOCAL_WORLD_SIZE: str(who.local_size),
        env_names.GROUP_RANK: str(who.host_rank),
        env_names.GROUP_WORLD_SIZE: str(who.host_count),
        env_names.ROLE_RANK: str(who.rank),
        env_names.ROLE_WORLD_SIZE: str(who.size),
        env_names.MASTER_ADDR: job.master_addr,
        env_names.MASTER_PORT: str(job.master_port),
        env_names.TORCHELASTIC_RUN_ID: job.run_id,
        env_names.TORCHELASTIC_RESTART_COUNT: str(job.restart_count),
        env_names.TORCHELASTIC_MAX_RESTARTS: "0",
        # The driver hosts the store (as torchrun's agent does), so every rank connects as a client
        # and no port is probed, released and hoped for.
        env_names.TORCHELASTIC_USE_AGENT_STORE: "True",
    }


def _horovod_vars(who: RankIdentity) -> dict[str, str]:
    return {
        env_names.HOROVOD_RANK: str(who.rank),
        env_names.HOROVOD_SIZE: str(who.size),
        env_names.HOROVOD_LOCAL_RANK: str(who.local_rank),
        env_names.HOROVOD_LOCAL_SIZE: str(who.local_size),
        env_names.HOROVOD_CROSS_RANK: str(who.cross_rank),
        env_names.HOROVOD_CROSS_SIZE: str(who.cross_size),
        env_names.HOROVOD_HOSTNAME: who.hostname,
    }


def worker_env(job: JobContract, who: RankIdentity) -> dict[str, str]:
    """The contract variables of one rank (to be laid over the base environment by the launcher).

    Args:
        job: what every rank shares.
        who: this rank's identity.

    Returns:
        A new dict of variable name to value; the caller's environment is not touched.
    """
    env = _torch_vars(job, who)
    env.update(_horovod_vars(who))
    env.update(
        {
            env_names.PHALANX_RUN_ID: job.run_id,
            env_names.PHALANX_CHANNEL: job.channel,
            env_names.PHALANX_SECRET: job.secret,
            env_names.PHALANX_START_TIMEOUT_S: repr(float(job.start_timeout_s)),
            env_names.PYTHONUNBUFFERED: "1",
        }
    )
    return env


def process_name(run_id: str) -> str:
    """The kernel's name (``/proc/<pid>/comm``, 15 bytes at most) of a job's warm-started ranks.

    A rank forked from the warm-start template keeps the template's start-up environment in
    ``/proc/<pid>/environ`` (only ``exec`` sets it), and so do the processes it forks: the name, which
    every fork inherits, marks them as the job's for the orphan sweep instead.
    """
    return "phx-" + run_id[-11:]


#: Flight Recorder entries every rank keeps unless told otherwise (torch's recommended size): the hang report
#: shows each rank's last ones.
FLIGHT_RECORDER_ENTRIES = 2000


def nic_env(interfaces: Sequence[str], user: Mapping[str, str] | None = None) -> dict[str, str]:
    """``NCCL_SOCKET_IFNAME`` and ``GLOO_SOCKET_IFNAME`` for the ranks of a job given ``interfaces``
    (``--network-interfaces``, ``network_interfaces=``, ``nics=``), so that NCCL's and gloo's own sockets use the
    NICs the user chose on a multi-NIC node; a variable the user set for the ranks is left as it is.

    Args:
        interfaces: the NIC names, in order (empty: nothing is set).
        user: the user's variables for the ranks.
    """
    names = ",".join(n.strip() for n in interfaces if n.strip())
    if not names:
        return {}
    given = user or {}
    return {key: names for key in (env_names.NCCL_SOCKET_IFNAME, env_names.GLOO_SOCKET_IFNAME) if key not in given}


def compose_env(base: Mapping[str, str], user: Mapping[str, str] | None, contract: Mapping[str, str],
                cpu_count: int | None = None) -> dict[str, str]:
    """Lay the user's variables, then the contract, over a base environment.

    The contract wins over the user's variables (a user cannot break rank assignment by accident), except
    ``PYTHONUNBUFFERED`` which a user may set explicitly.

    Args:
        base: the launcher's environment.
        user: the user's extra variables.
        contract: the rank's contract (:func:`worker_env`).
        cpu_count: this host's cores; when given and ``OMP_NUM_THREADS`` is set by neither ``base`` nor
            ``user``, each rank gets ``cpu_count // LOCAL_WORLD_SIZE`` threads (at least 1), so N ranks'
            OpenMP pools do not oversubscribe the host (torchrun does the same, with 1).
    """
    env = dict(base)
    env.update(user or {})
    for key, value in contract.items():
        if key == env_names.PYTHONUNBUFFERED and user and key in user:
            continue
        env[key] = value
    if cpu_count is not None and env_names.OMP_NUM_THREADS not in env:
        local_size = max(1, int(contract.get(env_names.LOCAL_WORLD_SIZE, "1")))
        env[env_names.OMP_NUM_THREADS] = str(max(1, cpu_count // local_size))
    if env_names.TORCH_NCCL_TRACE_BUFFER_SIZE not in env and env_names.TORCH_FR_BUFFER_SIZE not in env:
        env[env_names.TORCH_FR_BUFFER_SIZE] = str(FLIGHT_RECORDER_ENTRIES)  # torch's name since 2.7
    return env


@dataclass(frozen=True)
class WorkerContract:
    """What a worker process reads back from its environment."""

    identity: RankIdentity
    job: JobContract


def _int(environ: Mapping[str, str], name: str) -> int:
    raw = environ.get(name)
    if raw is None:
        raise WorkerContractError(f"{name} is not set; this process was not started by a phalanx launcher")
    try:
        return int(raw)
    except ValueError as e:
        raise WorkerContractError(f"{name}={raw!r} is not an integer") from e


def read_contract(environ: Mapping[str, str] | None = None) -> WorkerContract:
    """Parse the worker contract from an environment.

    Raises:
        WorkerContractError: a variable is missing or malformed (the message names it).
    """
    env = os.environ if environ is None else environ
    identity = RankIdentity(
        rank=_int(env, env_names.RANK),
        size=_int(env, env_names.WORLD_SIZE),
        local_rank=_int(env, env_names.LOCAL_RANK),
        local_size=_int(env, env_names.LOCAL_WORLD_SIZE),
        cross_rank=_int(env, env_names.HOROVOD_CROSS_RANK),
        cross_size=_int(env, env_names.HOROVOD_CROSS_SIZE),
        host_rank=_int(env, env_names.GROUP_RANK),
        host_count=_int(env, env_names.GROUP_WORLD_SIZE),
        hostname=env.get(env_names.HOROVOD_HOSTNAME, ""),
    )
    job = JobContract(
        run_id=env.get(env_names.PHALANX_RUN_ID, ""),
        master_addr=env.get(env_names.MASTER_ADDR, ""),
        master_port=_int(env, env_names.MASTER_PORT),
        channel=env.get(env_names.PHALANX_CHANNEL, ""),
        secret=env.get(env_names.PHALANX_SECRET, ""),
        start_timeout_s=START_TIMEOUT.get(env),
        restart_count=int(env.get(env_names.TORCHELASTIC_RESTART_COUNT, "0") or 0),
    )
    return WorkerContract(identity=identity, job=job)


def teardown_grace_s(environ: Mapping[str, str] | None = None) -> float:
    """Seconds between SIGTERM and SIGKILL when a job is torn down: ``PHALANX_TEARDOWN_GRACE_S`` or 3.

    Raises:
        SettingError: the variable is not a non-negative number.
    """
    return TEARDOWN_GRACE.get(environ)
