from __future__ import annotations

import pytest

from phalanx.env import JobContract, assign_ranks, compose_env, read_contract, worker_env
from phalanx.env.contract import teardown_grace_s
from phalanx.errors import SettingError, WorkerContractError
from phalanx.launch.core import JobSpec

JOB = JobContract(run_id="r1", master_addr="10.0.0.1", master_port=1234, channel="10.0.0.1:99", secret="ab" * 32)


def test_single_host_ranks_are_local() -> None:
    ids = assign_ranks(["h"] * 3)
    assert [i.local_rank for i in ids] == [0, 1, 2]
    assert {(i.local_size, i.cross_size, i.cross_rank, i.host_count) for i in ids} == {(3, 1, 0, 1)}


def test_two_hosts_interleaved_follow_horovod_definitions() -> None:
    ids = assign_ranks(["a", "b", "a", "b", "a"])
    assert [i.local_rank for i in ids] == [0, 0, 1, 1, 2]
    assert [i.local_size for i in ids] == [3, 2, 3, 2, 3]
    # cross ranks group ranks with the same local rank, in host order
    assert [i.cross_rank for i in ids] == [0, 1, 0, 1, 0]
    assert [i.cross_size for i in ids] == [2, 2, 2, 2, 1]
    assert [i.host_rank for i in ids] == [0, 1, 0, 1, 0]
    assert {i.host_count for i in ids} == {2}


def test_worker_env_carries_torch_horovod_and_phalanx_names() -> None:
    who = assign_ranks(["a", "b", "a", "b"])[3]
    env = worker_env(JOB, who)
    assert env["RANK"] == "3" and env["WORLD_SIZE"] == "4"
    assert env["LOCAL_RANK"] == "1" and env["LOCAL_WORLD_SIZE"] == "2"
    assert env["GROUP_RANK"] == "1" and env["GROUP_WORLD_SIZE"] == "2"
    assert env["MASTER_ADDR"] == "10.0.0.1" and env["MASTER_PORT"] == "1234"
    assert env["TORCHELASTIC_RUN_ID"] == "r1" and env["TORCHELASTIC_USE_AGENT_STORE"] == "True"
    assert env["HOROVOD_RANK"] == "3" and env["HOROVOD_CROSS_RANK"] == "1" and env["HOROVOD_HOSTNAME"] == "b"
    assert env["PHALANX_SECRET"] == JOB.secret and env["PHALANX_CHANNEL"] == JOB.channel
    assert all(isinstance(v, str) for v in env.values())


def test_compose_env_contract_wins_but_user_may_set_unbuffered() -> None:
    contract = worker_env(JOB, assign_ranks(["a"])[0])
    env = compose_env({"PATH": "/bin", "RANK": "9"}, {"RANK": "7", "FOO": "1", "PYTHONUNBUFFERED": "0"}, contract)
    assert env["RANK"] == "0" and env["FOO"] == "1" and env["PATH"] == "/bin"
    assert env["PYTHONUNBUFFERED"] == "0"


def test_read_contract_round_trip() -> None:
    who = assign_ranks(["a", "b", "a"])[2]
    back = read_contract(worker_env(JOB, who))
    assert back.identity == who
    assert back.job == JOB


def test_read_contract_names_missing_and_bad_variables() -> None:
    with pytest.raises(WorkerContractError, match="RANK is not set"):
        read_contract({})
    env = worker_env(JOB, assign_ranks(["a"])[0])
    env["WORLD_SIZE"] = "two"
    with pytest.raises(WorkerContractError, match="WORLD_SIZE='two' is not an integer"):
        read_contract(env)


def test_compose_env_shares_cores_unless_the_user_chose() -> None:
    contract = worker_env(JOB, assign_ranks(["a", "a", "a"])[0])
    assert compose_env({}, None, contract, cpu_count=8)["OMP_NUM_THREADS"] == "2"
    assert compose_env({}, None, contract, cpu_count=2)["OMP_NUM_THREADS"] == "1"
    assert compose_env({"OMP_NUM_THREADS": "4"}, None, contract, cpu_count=8)["OMP_NUM_THREADS"] == "4"
    assert compose_env({}, {"OMP_NUM_THREADS": "3"}, contract, cpu_count=8)["OMP_NUM_THREADS"] == "3"
    assert "OMP_NUM_THREADS" not in compose_env({}, None, contract)


def test_teardown_grace_knob(monkeypatch: pytest.MonkeyPatch) -> None:
    assert teardown_grace_s({}) == 3.0
    assert teardown_grace_s({"PHALANX_TEARDOWN_GRACE_S": "0.5"}) == 0.5
    with pytest.raises(SettingError, match="PHALANX_TEARDOWN_GRACE_S='soon' is not a number"):
        teardown_grace_s({"PHALANX_TEARDOWN_GRACE_S": "soon"})
    monkeypatch.setenv("PHALANX_TEARDOWN_GRACE_S", "7")
    assert JobSpec(np=1).teardown_grace_s == 7.0
