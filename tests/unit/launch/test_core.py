"""The launcher core: the pieces the local, Spark and hosts launchers share."""

from __future__ import annotations

import os
import sys
import threading
from typing import cast

from phalanx.job.channel import WorkerChannel
from phalanx.job.framing import Kind
from phalanx.launch.core import (
    DRAIN_WAIT_S,
    STOP_SLACK_S,
    monitor_config,
    new_run_id,
    start_timeout_hint,
    worker_argv,
)
from phalanx.launch.supervisor import HEARTBEAT, RankSupervisor, exit_event, parse_exit_event


def test_start_timeout_hint_names_the_knob_and_the_variable() -> None:
    assert start_timeout_hint("--start-timeout") == "--start-timeout (or the HOROVOD_START_TIMEOUT variable)"
    assert start_timeout_hint(None) == "the HOROVOD_START_TIMEOUT variable"
    assert start_timeout_hint(None, spark=True) == "the HOROVOD_SPARK_START_TIMEOUT variable"


def test_monitor_config_for_function_and_command_jobs() -> None:
    fn = monitor_config(3, True, 12.0, "x", teardown_grace_s=1.5)
    assert (fn.world_size, fn.expect_results, fn.expect_hello, fn.start_timeout_s) == (3, True, True, 12.0)
    assert fn.stop_wait_s == 1.5 + DRAIN_WAIT_S + STOP_SLACK_S
    cmd = monitor_config(2, False, 5.0, "y", teardown_grace_s=0.0)
    assert (cmd.expect_results, cmd.expect_hello, cmd.start_timeout_hint) == (False, False, "y")


def test_worker_argv() -> None:
    assert worker_argv(None) == [sys.executable, "-m", "phalanx.worker"]
    assert worker_argv(("echo", "hi"), "/opt/py") == ["/opt/py", "-m", "phalanx.worker.exec", "echo", "hi"]


def test_run_ids_are_fresh() -> None:
    ids = {new_run_id() for _ in range(50)}
    assert len(ids) == 50 and all(i.startswith("phalanx-") for i in ids)


def test_exit_event_round_trip_and_garbage() -> None:
    assert parse_exit_event(exit_event(-9)) == -9
    for body in (b"", b"{", b"[]", b'{"spawn": 1}', b'{"exit": "x"}', b"\xff"):
        assert parse_exit_event(body) is None


class _Frames:
    """A supervisor's channel that records what it sends; the driver goes away on ``close``."""

    def __init__(self) -> None:
        self.sent: list[tuple[Kind, bytes]] = []
        self.closed = threading.Event()

    def send(self, kind: Kind, body: bytes = b"") -> None:
        self.sent.append((kind, body))

    def wait_for_abort(self) -> None:
        self.closed.wait()


def test_a_host_agents_supervisor_beats_before_its_rank_writes_anything() -> None:
    """The driver names a silent host only once it has heard it beat: a rank that is past its first collective
    within the heartbeat period (forked warm) had sent its lines but no beat, and a link cut then went unnamed
    (issue 36; tests/hosts' silent-host test)."""
    frames = _Frames()
    supervisor = RankSupervisor(cast(WorkerChannel, frames), 0, 1.0, heartbeat=True)
    assert supervisor.run(["/bin/echo", "READY"], dict(os.environ)) == 0
    frames.closed.set()
    kinds = [kind for kind, _ in frames.sent]
    assert frames.sent[0] == (Kind.EVENT, HEARTBEAT), frames.sent
    assert Kind.LOG in kinds, frames.sent
