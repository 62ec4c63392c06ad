"""srun's and mpirun's rank variables read as torch's contract (pure functions)."""

from __future__ import annotations

import pytest

from phalanx.env.foreign import contract_from_foreign, expand_nodelist, tasks_per_node
from phalanx.errors import WorkerContractError

SLURM = {"SLURM_PROCID": "3", "SLURM_NTASKS": "4", "SLURM_LOCALID": "1", "SLURM_NODEID": "1",
         "SLURM_NNODES": "2", "SLURM_TASKS_PER_NODE": "2(x2)", "SLURM_JOB_NODELIST": "node[07-08]",
         "SLURM_JOB_ID": "4242"}


def test_nodelist_expansion() -> None:
    assert expand_nodelist("node[01-03,07],gpu1") == ["node01", "node02", "node03", "node07", "gpu1"]
    assert expand_nodelist("a") == ["a"]
    with pytest.raises(WorkerContractError, match="cannot read the range"):
        expand_nodelist("n[1-x]")


def test_tasks_per_node() -> None:
    assert tasks_per_node("2(x3),1") == [2, 2, 2, 1]
    with pytest.raises(WorkerContractError, match="SLURM_TASKS_PER_NODE"):
        tasks_per_node("two")


def test_slurm_variables_become_the_torch_contract() -> None:
    assert contract_from_foreign(SLURM) == {
        "RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "1",
        "GROUP_WORLD_SIZE": "2", "MASTER_ADDR": "node07", "MASTER_PORT": str(15000 + 4242)}


def test_given_master_address_and_port_win() -> None:
    got = contract_from_foreign({**SLURM, "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "1234"})
    assert "MASTER_ADDR" not in got and "MASTER_PORT" not in got


def test_a_phalanx_or_torchrun_contract_is_left_alone() -> None:
    assert contract_from_foreign({**SLURM, "RANK": "0"}) == {}
    assert contract_from_foreign({}) == {}


def test_open_mpi_and_mpich() -> None:
    ompi = {"OMPI_COMM_WORLD_RANK": "5", "OMPI_COMM_WORLD_SIZE": "8", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
            "OMPI_COMM_WORLD_LOCAL_SIZE": "4", "MASTER_ADDR": "n1"}
    assert contract_from_foreign(ompi) == {"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4",
                                           "GROUP_RANK": "1", "GROUP_WORLD_SIZE": "2", "MASTER_PORT": "29500"}
    mpich = {"PMI_RANK": "0", "PMI_SIZE": "2", "MASTER_ADDR": "n1", "MASTER_PORT": "7"}
    assert contract_from_foreign(mpich) == {"RANK": "0", "WORLD_SIZE": "2"}


def test_mpirun_without_master_addr_says_so() -> None:
    with pytest.raises(WorkerContractError, match=r"mpirun -x MASTER_ADDR=node1"):
        contract_from_foreign({"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "2"})
