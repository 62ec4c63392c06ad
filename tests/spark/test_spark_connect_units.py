"""The pure pieces of phalanx.spark's Spark Connect path, without a JVM: the signed outcome and its
chunks, the slot count from a session's settings, the client's address, the log relay."""

from __future__ import annotations

import json
import pickle
import threading
from types import SimpleNamespace
from typing import Any

import pytest

from phalanx.errors import InvalidArgumentError, SlotsUnavailableError, SparkJobError, WorkerFailedError
from phalanx.job.channel import Custom, DriverChannel
from phalanx.job.records import LogLine, Stream
from phalanx.spark.connect import session as connect_session
from phalanx.spark.connect import wire as connect_wire
from phalanx.spark.connect.host import LogRelay, probe_client

SECRET = "ab" * 32


class _Conf:
    def __init__(self, values: dict[str, str]) -> None:
        self.values = values

    def get(self, key: str, default: Any = None) -> Any:
        return self.values.get(key, default)


def _session(**values: str) -> Any:
    return SimpleNamespace(conf=_Conf({k.replace("_", "."): v for k, v in values.items()}))


def _rows(batches: list[Any]) -> list[Any]:
    return [SimpleNamespace(**{k: v[0] for k, v in b.to_pydict().items()}) for b in batches]


def test_outcome_round_trips_in_chunks_under_the_arrow_batch_size() -> None:
    pytest.importorskip("pyarrow")
    big = bytes(range(256)) * 4096  # 1 MiB of result: several chunks
    outcome = connect_wire.Outcome(values=[big, None], rank0_stdout=["a"], logs=[(1, "stderr", "x")], link="why")
    batches = list(connect_wire.rows(0, connect_wire.OUTCOME, connect_wire.sign(outcome, SECRET)))
    assert len(batches) > 1 and all(len(b.column("data")[0].as_py()) <= connect_wire.CHUNK_BYTES for b in batches)
    status = list(connect_wire.rows(1, connect_wire.STATUS, connect_wire.status_body(1, 3, False, "lost")))
    rows = _rows(status + batches)
    collected = connect_wire.assemble(reversed(rows))  # order is not guaranteed by collect()
    assert collected.statuses == [{"rank": 1, "exit": 3, "reported": False, "error": "lost"}]
    assert collected.outcome is not None
    back = connect_wire.verify(collected.outcome, SECRET)
    assert back.values == [big, None] and back.logs == [(1, "stderr", "x")] and back.link == "why"


def test_outcome_with_another_signature_is_refused_before_unpickling() -> None:
    blob = connect_wire.sign(connect_wire.Outcome(), SECRET)
    with pytest.raises(SparkJobError, match="signature"):
        connect_wire.verify(blob, "cd" * 32)
    forged = blob[:32] + pickle.dumps(connect_wire.Outcome(values=[b"x"]))
    with pytest.raises(SparkJobError, match="signature"):
        connect_wire.verify(forged, SECRET)


def test_errors_travel_pickled_with_their_root_cause() -> None:
    from phalanx.errors import RankFailure

    error = WorkerFailedError([RankFailure(rank=1, summary="ValueError: x", traceback="tb", log_tail=("l",))])
    back = connect_wire.verify(connect_wire.sign(connect_wire.Outcome(error=pickle.dumps(error)), SECRET), SECRET)
    assert back.error is not None
    loaded = pickle.loads(back.error)
    assert isinstance(loaded, WorkerFailedError) and loaded.root_cause.rank == 1


@pytest.mark.parametrize(("values", "slots"), [
    ({"spark_master": "local[2]"}, 2),
    ({"spark_master": "local"}, 1),
    ({"spark_master": "local[4, 3]", "spark_task_cpus": "2"}, 2),
    ({"spark_master": "local-cluster[2, 3, 1024]"}, 6),
    ({"spark_master": "spark://m:7077", "spark_executor_instances": "3", "spark_executor_cores": "4"}, 12),
    ({"spark_master": "yarn", "spark_executor_instances": "3", "spark_executor_cores": "4",
      "spark_dynamicAllocation_enabled": "true"}, None),
    ({"spark_master": "k8s://x"}, None),
])
def test_task_slots_come_from_the_sessions_settings(values: dict[str, str], slots: int | None) -> None:
    assert connect_session.task_slots(_session(**values)) == slots


def test_local_star_counts_the_server_hosts_cores(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(connect_session, "server_cores", lambda session: 8)  # a query on a real server
    assert connect_session.task_slots(_session(spark_master="local[*]", spark_task_cpus="2")) == 4
    assert connect_session.task_slots(_session(spark_master="local[*, 3]")) == 8


def test_slot_shortage_dynamic_allocation_and_unknown_slots_are_clear_errors() -> None:
    with pytest.raises(SlotsUnavailableError, match=r"3 ranks were asked for .* only 2 task\(s\)"):
        connect_session.check_slots(_session(spark_master="local[2]"), 3)
    connect_session.check_slots(_session(spark_master="k8s://x"), 64)  # unknown: the client's start watch decides
    with pytest.raises(InvalidArgumentError, match="pass the number of ranks"):
        connect_session.every_slot(_session(spark_master="k8s://x"))
    dynamic = _session(spark_master="yarn", spark_dynamicAllocation_enabled="true")
    with pytest.raises(SlotsUnavailableError, match=r"spark\.dynamicAllocation\.enabled=false"):
        connect_session.check_slots(dynamic, 1)
    connect_session.check_slots(_session(spark_master="local[2]", spark_dynamicAllocation_enabled="true"), 2)


def test_stage_watch_counts_only_its_querys_thread_and_a_spark_4_server() -> None:
    spark4 = SimpleNamespace(version="4.3.0", conf=_Conf({}))
    watch = connect_session.StageWatch(spark4)
    assert watch.armed
    stage = [SimpleNamespace(num_tasks=2)]
    watch(stages=stage, inflight_tasks=2, operation_id="other", done=False)  # another thread's query
    assert not watch.started.is_set()
    watch.thread_id = threading.get_ident()
    watch(stages=[], inflight_tasks=0, operation_id="ours", done=True)  # the end of a query with no stage
    assert not watch.started.is_set()
    watch(stages=stage, inflight_tasks=2, operation_id="ours", done=False)
    assert watch.started.is_set()
    off = SimpleNamespace(version="4.3.0", conf=_Conf({connect_session.PROGRESS_INTERVAL_KEY: "-1"}))
    assert not connect_session.StageWatch(off).armed
    assert not connect_session.StageWatch(SimpleNamespace(version="3.5.1", conf=_Conf({}))).armed


def test_client_host_is_the_override_or_the_route_to_the_server() -> None:
    session = SimpleNamespace(client=SimpleNamespace(host="127.0.0.1"))
    assert connect_session.client_host(session, {"PHALANX_CONNECT_CLIENT_HOST": "10.1.2.3"}) == "10.1.2.3"
    assert connect_session.client_host(session, {}) == "127.0.0.1"


def test_the_log_link_listens_where_the_cluster_reaches_the_client_never_everywhere() -> None:
    """It listened on 0.0.0.0, against docs/design.md (issue 32, item 6)."""
    session = SimpleNamespace(client=SimpleNamespace(host="127.0.0.1"))
    assert connect_session.client_bind_host(session, "127.0.0.2") == "127.0.0.2"  # one of this machine's
    assert connect_session.client_bind_host(session, "192.0.2.7") == "127.0.0.1"  # behind NAT: the route's


def test_log_relay_keeps_records_until_the_client_is_reached_then_streams_them() -> None:
    link = DriverChannel(1, b"", bind_host="127.0.0.1")
    relay = LogRelay()
    relay.write(LogLine(rank=1, stream=Stream.STDERR, text="early"))
    relay.message(0, "hello")
    try:
        probe_client(relay, link.address, link.secret, 5.0)
        assert relay.link_error == ""
        relay.write(LogLine(rank=0, stream=Stream.STDOUT, text="late"))
        relay.flush()
        assert relay.close() == []
        got: list[list[Any]] = []
        while len(got) < 3:
            event = link.events.get(timeout=5)
            if isinstance(event, Custom):
                got += json.loads(event.body)["logs"]
        assert got == [[1, "stderr", "early"], [0, "message", "hello"], [0, "stdout", "late"]]
    finally:
        link.close()


def test_log_relay_without_a_client_keeps_records_within_its_budget_and_says_why() -> None:
    relay = LogRelay(budget_bytes=100)
    probe_client(relay, "127.0.0.1:1", SECRET, 1.0)  # nothing listens there
    assert "could not reach the client at 127.0.0.1:1" in relay.link_error
    for i in range(10):
        relay.write(LogLine(rank=0, stream=Stream.STDOUT, text=f"line {i} " + "x" * 10))
    kept = relay.close()
    assert kept[0] == (0, "stdout", "line 0 " + "x" * 10) and len(kept) + relay.dropped == 10 and relay.dropped > 0


def test_log_relay_link_from_a_wrong_secret_is_refused() -> None:
    link = DriverChannel(1, b"", bind_host="127.0.0.1")
    relay = LogRelay()
    try:
        probe_client(relay, link.address, SECRET, 5.0)
        assert "could not reach the client" in relay.link_error
        assert link.events.empty()
    finally:
        link.close()


def test_probe_against_a_silent_listener_is_bounded() -> None:
    import socket

    with socket.create_server(("127.0.0.1", 0)) as silent:  # accepts, never sends the nonce
        relay = LogRelay()
        thread = threading.Thread(target=probe_client, args=(relay, f"127.0.0.1:{silent.getsockname()[1]}",
                                                             SECRET, 0.5))
        thread.start()
        thread.join(10)
        assert not thread.is_alive() and "could not reach the client" in relay.link_error

