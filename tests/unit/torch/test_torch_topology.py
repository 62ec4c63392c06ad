"""hvd.init()'s rank identity read from launcher variables: the worker contract's RankIdentity."""

from __future__ import annotations

from phalanx.env import JobContract, RankIdentity, assign_ranks, worker_env

# white-box: hvd.init()'s reading of the topology, without a process group (no public name)
from phalanx.torch._setup.state import topology_from_env


def test_a_launchers_contract_reads_back_as_the_identity_it_wrote() -> None:
    job = JobContract(run_id="r", master_addr="127.0.0.1", master_port=1, channel="127.0.0.1:2", secret="s" * 64)
    for who in assign_ranks(["a", "a", "b", "b", "c", "c"]):
        assert topology_from_env(worker_env(job, who), who.rank, who.size) == who


def test_torchrun_names_and_defaults() -> None:
    torchrun = {"LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "1", "GROUP_WORLD_SIZE": "2",
                "HOROVOD_HOSTNAME": "n1"}
    assert topology_from_env(torchrun, 3, 4) == RankIdentity(3, 4, 1, 2, 1, 2, 1, 2, "n1")
    alone = topology_from_env({}, 2, 4)  # nothing said: one host
    assert (alone.local_rank, alone.local_size, alone.cross_rank, alone.cross_size) == (2, 4, 0, 1)
    assert (alone.host_rank, alone.host_count) == (0, 1) and alone.hostname
