"""The elastic decision object, the round keys and the elastic monitor (no processes)."""

from __future__ import annotations

import queue

import cloudpickle
import pytest

from phalanx.env import rounds as elastic_keys
from phalanx.errors import InvalidArgumentError, WorkerFailedError
from phalanx.job.channel import Result
from phalanx.job.elastic_policy import ElasticMonitor, ElasticPolicy, HostsUpdated
from phalanx.job.monitor import MonitorConfig, RankExit
from phalanx.job.records import Hello
from phalanx.launch.api import elastic_spec


def test_policy_reforms_with_replacements_up_to_max_np() -> None:
    policy = ElasticPolicy(min_np=2, max_np=4, reset_limit=3)
    assert policy.decide(alive=3, free_slots=1, resets=0).size == 4
    assert policy.decide(alive=3, free_slots=5, resets=2).size == 4
    assert policy.decide(alive=2, free_slots=0, resets=0).reform


def test_policy_fails_below_min_np_and_after_reset_limit() -> None:
    policy = ElasticPolicy(min_np=2, max_np=4, reset_limit=1)
    below = policy.decide(alive=1, free_slots=0, resets=0)
    assert not below.reform and "min_np=2" in below.reason
    spent = policy.decide(alive=3, free_slots=1, resets=1)
    assert not spent.reform and "reset_limit=1" in spent.reason
    # Horovod's text, which users grep for (horovod.runner.elastic.constants.RESET_LIMIT_EXCEEDED_MESSAGE)
    assert spent.reason.startswith("Horovod was shutdown because number of resets during elastic job exceeded "
                                   "limit: 1")
    assert ElasticPolicy(1, 2, None).decide(alive=1, free_slots=1, resets=10**6).reform


def test_policy_fails_when_no_survivor_holds_the_state() -> None:
    decision = ElasticPolicy(1, 2, None).decide(alive=1, free_slots=1, resets=1, holding_state=0)
    assert not decision.reform and "holds the training state" in decision.reason


@pytest.mark.parametrize("args", [(0, 2, None), (3, 2, None), (1, 2, -1)])
def test_policy_rejects_bad_bounds(args: tuple[int, int, int | None]) -> None:
    with pytest.raises(InvalidArgumentError):
        ElasticPolicy(*args)


def test_elastic_spec_only_when_asked_and_np_within_bounds() -> None:
    assert elastic_spec(2, None, None, None) is None
    spec = elastic_spec(2, 1, None, 3)
    assert spec is not None and (spec.policy.min_np, spec.policy.max_np, spec.policy.reset_limit) == (1, 2, 3)
    with pytest.raises(InvalidArgumentError, match="min_np <= np <= max_np"):
        elastic_spec(4, 1, 2, None)
    with pytest.raises(InvalidArgumentError, match="PHALANX_ELASTIC_TIMEOUT_S"):
        elastic_spec(2, 1, 2, None, {"PHALANX_ELASTIC_TIMEOUT_S": "soon"})


def test_round_plan_sets_assignments_then_latest_then_marker() -> None:
    plan = elastic_keys.round_plan(3, [0, 5])
    assert plan == [(elastic_keys.assign_key(3, 0), "0,2"), (elastic_keys.assign_key(3, 5), "1,2"),
                    (elastic_keys.LATEST_KEY, "3"), (elastic_keys.round_key(3), "1")]
    assert elastic_keys.decode_assignment(b"1,2") == (1, 2)
    with pytest.raises(ValueError, match="rank,size"):
        elastic_keys.decode_assignment("x")


def _monitor(events: list[object], policy: ElasticPolicy) -> tuple[ElasticMonitor, list[tuple[list[int], int]]]:
    q: queue.Queue[object] = queue.Queue()
    for e in events:
        q.put(e)
    calls: list[tuple[list[int], int]] = []

    def reform(alive: list[int], size: int) -> list[int]:
        calls.append((alive, size))
        q.put(Hello(2, 3, "h"))
        q.put(Result(2, cloudpickle.dumps("new")))
        q.put(RankExit(2, 0))
        return [*alive, 2]

    cfg = MonitorConfig(world_size=2, expect_results=True, expect_hello=True, start_timeout_s=5,
                        start_timeout_hint="start_timeout=", stop_wait_s=0.5)
    mon = ElasticMonitor(cfg, q, [], stop_all=lambda: None, policy=policy, reform=reform,  # type: ignore[arg-type]
                         free_slots=lambda alive: 2 - len(alive))
    return mon, calls


def test_monitor_replaces_a_killed_worker_and_returns_the_final_world() -> None:
    events = [Hello(0, 1, "h"), Hello(1, 2, "h"), RankExit(1, -9), Result(0, cloudpickle.dumps("zero")),
              RankExit(0, 0)]
    mon, calls = _monitor(events, ElasticPolicy(1, 2, 2))
    assert mon.run() == ["zero", "new"]
    assert calls == [([0], 2)] and mon.resets == 1


def _leaving_monitor(policy: ElasticPolicy) -> tuple[ElasticMonitor, list[tuple[list[int], int]]]:
    # Workers 0 and 1 said hello; then the launcher retires worker 1 (its host left) and posts HostsUpdated.
    q: queue.Queue[object] = queue.Queue()
    calls: list[tuple[list[int], int]] = []

    def reform(alive: list[int], size: int) -> list[int]:
        calls.append((alive, size))
        q.put(Result(0, cloudpickle.dumps("zero")))
        q.put(RankExit(0, 0))
        return alive[:size]

    for e in (Hello(0, 1, "h"), Hello(1, 2, "h"), HostsUpdated(1)):
        q.put(e)
    cfg = MonitorConfig(world_size=2, expect_results=True, expect_hello=True, start_timeout_s=5,
                        start_timeout_hint="start_timeout=", stop_wait_s=0.5)
    mon = ElasticMonitor(cfg, q, [], stop_all=lambda: None, policy=policy, reform=reform,  # type: ignore[arg-type]
                         free_slots=lambda alive: 0, leaving=lambda: {1})
    return mon, calls


def test_monitor_reforms_without_a_retired_worker_at_once_and_never_waits_for_its_end() -> None:
    mon, calls = _leaving_monitor(ElasticPolicy(1, 2))
    assert mon.run() == ["zero"]  # worker 1 never reported its end: the launcher's teardown stops it
    assert calls == [([0], 1)] and mon.resets == 1 and mon.world == [0]
    # Below min_np nothing re-forms early: the retired worker's end is judged as any loss, and fails the job.
    mon, calls = _leaving_monitor(ElasticPolicy(2, 2))
    mon.events.put(RankExit(1, -15))  # type: ignore[attr-defined]
    with pytest.raises(WorkerFailedError, match="below min_np=2"):
        mon.run()
    assert calls == [] and mon.world == [0, 1]


def test_monitor_gives_up_at_the_reset_limit_with_the_reason() -> None:
    events = [Hello(0, 1, "h"), Hello(1, 2, "h"), RankExit(1, -9), RankExit(0, -15)]
    mon, calls = _monitor(events, ElasticPolicy(1, 2, 0))
    with pytest.raises(WorkerFailedError, match="reset_limit=0") as info:
        mon.run()
    assert calls == [] and info.value.root_cause.rank == 1


def test_phalanxrun_elastic_flags() -> None:
    from phalanx.cli.main import parse_config

    config = parse_config(["-np", "3", "--min-np", "2", "--reset-limit", "5", "true"])
    assert config.elastic is not None and config.elastic.policy == ElasticPolicy(2, 3, 5)
    assert parse_config(["-np", "3", "true"]).elastic is None
    with pytest.raises(InvalidArgumentError, match="min_np"):
        parse_config(["-np", "3", "--min-np", "4", "true"])
