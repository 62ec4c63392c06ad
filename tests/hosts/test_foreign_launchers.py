"""hvd.init() under other launchers across two simulated hosts: Slurm's variables (set by hand, as srun
would) and torchrun multi-node with the c10d rendezvous, each process started inside its host."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from tests.hosts.simhosts import Cluster
from tests.hosts.test_phalanxrun_hosts import JOB, check_job, results

pytestmark = [pytest.mark.multiprocess, pytest.mark.hosts, pytest.mark.timeout(180)]

_CONTRACT = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "HOROVOD_RANK", "PHALANX_CHANNEL")


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in _CONTRACT and not k.startswith(("SLURM_", "TORCHELASTIC"))}
    return {**env, **extra}


def finish(procs: list[subprocess.Popen[str]], timeout: float) -> str:
    out = []
    try:
        for p in procs:
            stdout, stderr = p.communicate(timeout=timeout)
            assert p.returncode == 0, stderr[-3000:]
            out.append(stdout)
    finally:
        for p in procs:
            p.kill()
            p.wait()
    return "".join(out)


def test_slurm_variables(cluster: Cluster) -> None:
    procs = []
    for rank in range(4):
        env = clean_env(SLURM_PROCID=str(rank), SLURM_NTASKS="4", SLURM_LOCALID=str(rank % 2),
                        SLURM_NODEID=str(rank // 2), SLURM_NNODES="2", SLURM_TASKS_PER_NODE="2(x2)",
                        SLURM_JOB_NODELIST="hosta,hostb", SLURM_JOB_ID="77")
        host = "hosta" if rank < 2 else "hostb"
        argv = cluster.argv_on(host, [sys.executable, JOB, "quick"])
        procs.append(subprocess.Popen(argv, env=env, cwd=cluster.workdir, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))
    check_job(finish(procs, 150), quick=True)
    cluster.wait_clean(10.0)


def test_torchrun_two_nodes_c10d(cluster: Cluster) -> None:
    """One rank per node: what is tested is torchrun's multi-node rendezvous (each torchrun process and each
    rank imports torch, so more ranks per node would only cost time)."""
    procs = []
    for host in ("hosta", "hostb"):
        argv = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
                "--rdzv-backend", "c10d", "--rdzv-endpoint", f"{cluster.hosts['hosta'].address}:29400",
                "--rdzv-id", "phx-test", JOB, "quick"]
        procs.append(subprocess.Popen(cluster.argv_on(host, argv), env=clean_env(), cwd=cluster.workdir,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    stdout = finish(procs, 150)
    first = results(stdout)[0]["host"]
    check_job(stdout, first, "hostb" if first == "hosta" else "hosta", quick=True, per_host=1)
    cluster.wait_clean(10.0)
