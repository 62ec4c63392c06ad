"""The elastic Spark launcher's decisions without Spark: which slot hosts a replacement, argument checks."""

from __future__ import annotations

import json
from typing import Any

import pytest

from phalanx.env import rounds as elastic_keys
from phalanx.errors import InvalidArgumentError, SparkJobError
from phalanx.job.channel import Role
from phalanx.job.elastic_policy import ElasticPolicy
from phalanx.launch.core import JobSpec
from phalanx.launch.elasticity import Elasticity, ElasticSpec
from phalanx.spark.elastic_run import elastic_options
from phalanx.spark.launcher import BarrierTasks


class FakeChannel:
    def __init__(self, gone: set[int]) -> None:
        self.sent: list[tuple[int, dict[str, Any]]] = []
        self.gone = gone

    def command(self, rank: int, role: Role, body: bytes) -> bool:
        assert role is Role.SUPERVISOR
        if rank in self.gone:
            return False
        self.sent.append((rank, json.loads(body)))
        return True


class FakeStore:
    def __init__(self) -> None:
        self.keys: dict[str, str] = {}

    def wait_ready(self, timeout_s: float) -> bool:
        return True

    error = None

    def set(self, key: str, value: str) -> None:
        self.keys[key] = value

    def check(self, key: str) -> bool:
        return key in self.keys


def _elastic(np: int, gone: set[int] | None = None) -> tuple[Elasticity, BarrierTasks, FakeChannel, FakeStore]:
    spec = ElasticSpec(ElasticPolicy(1, np, 3))
    tasks = BarrierTasks(JobSpec(np=np), spec, lambda rank, text: None)
    elasticity = Elasticity(spec, tasks, np, np)
    channel, store = FakeChannel(gone or set()), FakeStore()
    tasks.channel = channel  # type: ignore[assignment]
    elasticity.begin(store)  # type: ignore[arg-type]
    return elasticity, tasks, channel, store


def test_a_lost_worker_is_replaced_in_its_own_slot_and_the_round_is_published() -> None:
    elasticity, tasks, channel, store = _elastic(3)
    assert store.keys[elastic_keys.round_key(0)] == "1"
    assert tasks.free_slots([0, 2]) == 1
    world = elasticity._reform([0, 2], 3)
    assert world == [0, 2, 3] and channel.sent == [(1, {"spawn": 3})] and tasks.slot_of[3] == 1
    assert elastic_keys.decode_assignment(store.keys[elastic_keys.assign_key(1, 3)]) == (2, 3)
    # The replacement dies too: the next one goes to the same slot, with a new id.
    assert elasticity._reform([0, 2], 3) == [0, 2, 4] and channel.sent[-1] == (1, {"spawn": 4})
    assert not elasticity._holds_state(4)
    store.set(elastic_keys.synced_key(2, 4), "1")
    assert elasticity._holds_state(4) and elasticity._holds_state(0)


def test_a_gone_task_gets_no_replacement_and_a_failed_stage_gives_up() -> None:
    elasticity, tasks, channel, _ = _elastic(2, gone={1})
    assert elasticity._reform([0], 2) == [0] and channel.sent == []
    assert tasks.give_up() == ""
    tasks.spark_error = SparkJobError("stage failed")
    assert tasks.free_slots([0]) == 0 and "Spark failed the barrier stage" in tasks.give_up()


def test_elastic_options_are_checked_before_spark_starts() -> None:
    assert elastic_options() is None
    options = elastic_options(min_np=1, reset_limit=2, checkpoint_dir="/tmp/x")
    assert options is not None and options.reset_limit == 2 and options.max_np is None
    options.check_np(2)
    with pytest.raises(InvalidArgumentError, match="min_np <= np <= max_np"):
        elastic_options(min_np=3).check_np(2)  # type: ignore[union-attr]
    with pytest.raises(InvalidArgumentError, match="min_np <= max_np"):
        elastic_options(min_np=3, max_np=2)
    with pytest.raises(InvalidArgumentError, match="reset_limit"):
        elastic_options(reset_limit=-1)
    with pytest.raises(InvalidArgumentError, match="min_np"):
        elastic_options(min_np="2")
    with pytest.raises(InvalidArgumentError, match="checkpoint_dir"):
        elastic_options(checkpoint_dir="")


def test_horovod_runner_and_distributor_opt_in_check_their_arguments_up_front(tmp_path: Any) -> None:
    from phalanx.spark import HorovodRunner, TorchDistributor

    assert HorovodRunner(np=2).elastic is None and TorchDistributor(2).elastic is None
    runner = HorovodRunner(np=2, min_np=1, reset_limit=2, checkpoint_dir=str(tmp_path))
    assert runner.elastic is not None and runner.elastic.reset_limit == 2
    with pytest.raises(InvalidArgumentError, match=r"min_np <= np <= max_np; got 3 <= 2"):
        HorovodRunner(np=2, min_np=3)
    with pytest.raises(InvalidArgumentError, match=r"min_np <= np <= max_np; got 1 <= 3 <= 2"):
        HorovodRunner(np=-3, max_np=2)
    with pytest.raises(InvalidArgumentError, match="reset_limit must be an int >= 0; got 'x'"):
        TorchDistributor(2, local_mode=False, reset_limit="x")  # type: ignore[arg-type]
    script = tmp_path / "train.py"
    script.write_text("")
    with pytest.raises(InvalidArgumentError, match="not a script"):
        TorchDistributor(2, local_mode=False, use_gpu=False, min_np=1).run(str(script))
