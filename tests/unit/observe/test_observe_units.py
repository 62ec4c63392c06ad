"""The observe layer without a job: the stats record, the board, the page server's guard, /metrics, MLflow
(against a stand-in module: the real one is too large to install for make test), the options, and the
monitor's observer hook."""

from __future__ import annotations

import json
import logging
import queue
import re
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest

from phalanx.errors import InvalidArgumentError, WorkerFailedError
from phalanx.job import stats
from phalanx.job.monitor import JobMonitor, MonitorConfig, RankExit
from phalanx.job.observation import JobEnded, Observation, RankEnded, RankStarted, Reformed
from phalanx.job.records import ErrorRecord, Hello, LogLine, Stream
from phalanx.job.stats import KindStats, RankStats
from phalanx.observe import JobBoard, options
from phalanx.observe.mlflow_log import MlflowLog
from phalanx.observe.server import Dashboard


def _rec(rank: int, clock: float, steps: int, wait: float, current: str = "", host: str = "h1") -> RankStats:
    return RankStats(rank=rank, pid=100 + rank, host=host, clock_s=clock, steps=steps, wait_s=wait,
                     nbytes=1000 * steps, current=current, kinds={"allreduce": KindStats(steps, wait, 1000 * steps)})


# --- the stats record


def test_stats_record_round_trips() -> None:
    rec = _rec(3, 12.5, 40, 1.25, current="allreduce")
    assert RankStats.decode(rec.encode()) == rec


@pytest.mark.parametrize("change", [
    {"steps": -1}, {"wait_s": float("nan")}, {"host": "a" * 60}, {"host": "<script>"}, {"current": "x\ny"},
    {"kinds": {f"k{i}": [1, 0.0, 1] for i in range(17)}}, {"rank": True},
])
def test_stats_record_refuses_what_is_out_of_bounds(change: dict[str, Any]) -> None:
    data = json.loads(_rec(0, 1.0, 1, 0.1).encode())
    data.update(change)
    with pytest.raises(ValueError):
        RankStats.decode(json.dumps(data).encode())
    with pytest.raises(ValueError):
        RankStats.decode(b"{" + b" " * stats.MAX_BYTES + b"}")


def test_counting_is_off_until_a_reporter_starts(monkeypatch: pytest.MonkeyPatch) -> None:
    stats.step()
    assert stats.begin("allreduce") == 0.0 and not stats.reporting()
    sent: queue.Queue[bytes] = queue.Queue()
    monkeypatch.setenv("PHALANX_STATS_INTERVAL_S", "0.05")
    assert stats.start_reporter(sent.put, rank=1, host="h9")
    try:
        stats.step()
        stats.end("allreduce", stats.begin("allreduce"), 64)
        rec = RankStats.decode(sent.get(timeout=10))
        while rec.steps < 1 or rec.nbytes < 64:
            rec = RankStats.decode(sent.get(timeout=10))
        assert (rec.rank, rec.host, rec.kinds["allreduce"].count) == (1, "h9", 1)
    finally:
        stats.stop_reporter()
    last = RankStats.decode(sent.get(timeout=10))  # the final record, sent at stop even when unchanged
    while not sent.empty():
        last = RankStats.decode(sent.get())
    assert last.steps >= 1 and not stats.reporting()


# --- the board


def test_board_follows_a_job() -> None:
    board = JobBoard("phalanx-x", 2)
    board.observe(RankStarted(0, 11, "h1", board.started + 0.5))
    board.observe(_rec(1, 1.0, 0, 0.0))  # a command's rank: its first record starts it
    board.observe(_rec(0, 1.0, 10, 0.1))
    board.observe(_rec(0, 2.0, 30, 0.6, current="allreduce"))
    board.observe(_rec(1, 2.0, 20, 0.0))
    for i in range(100):
        board.observe(LogLine(0, Stream.STDOUT, f"line {i} " + "x" * 1000))
    snap = board.snapshot()
    r0, r1 = snap["ranks"]
    assert (r0["state"], r0["pid"], r0["steps"], r0["steps_per_s"], r0["current"]) == ("collective", 11, 30, 20.0,
                                                                                       "allreduce")
    assert r0["start_latency_s"] == pytest.approx(0.5) and r1["host"] == "h1" and r1["state"] == "running"
    assert r0["wait_share"] == pytest.approx(0.5) and snap["straggler"] == 1  # rank 0 waits for rank 1
    assert len(r0["logs"]) == 40 and r0["logs"][-1][1].startswith("line 99") and len(r0["logs"][-1][1]) == 400
    assert snap["summary"][0]["kind"] == "allreduce" and snap["summary"][0]["count"] == 50
    board.observe(RankEnded(1, -9, True, "process ended with signal SIGKILL (9)"))
    board.observe(RankEnded(0, 143, True, "process ended with signal SIGTERM (15)", stopped=True))
    board.observe(Reformed(1, (0, 2)))
    board.observe(JobEnded(False, "rank 1 failed: ..."))
    snap = board.snapshot()
    assert [r["state"] for r in snap["ranks"]] == ["stopped", "failed", "starting"]
    assert snap["end"]["ok"] is False and snap["resets"] == 1 and snap["alive"] == 0
    assert [e[1] for e in snap["events"]][-2:] == ["world re-formed (#1): workers [0, 2]", "job failed"]
    version, body = board.json()
    assert board.json() == (version, body) and json.loads(body)["version"] == version


# --- the page server


@pytest.fixture
def page() -> Iterator[Dashboard]:
    server = Dashboard("127.0.0.1", 0)
    board = JobBoard("phalanx-y", 2)
    board.observe(_rec(0, 1.0, 5, 0.5))
    board.observe(_rec(0, 2.0, 9, 0.7))
    server.show(board)
    try:
        yield server
    finally:
        server.close()


def _get(url: str, headers: dict[str, str] | None = None) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers or {}), timeout=10) as answer:
            return answer.status, answer.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def test_only_the_token_opens_the_page(page: Dashboard) -> None:
    base = f"http://127.0.0.1:{page.port}"
    for path in ("/", "/?token=", "/?token=" + page.token[:-1], "/snapshot", "/metrics?token=nope", "/events"):
        status, body = _get(base + path)
        assert status == 403 and b"phalanx-y" not in body, path
    status, body = _get(page.url)
    assert status == 200 and b"<script>" in body
    assert not re.search(rb"<script[^>]+src|<link|@import|url\(|//cdn", body)  # nothing loaded from elsewhere
    assert b"/*SCRIPT*/" not in body and b"/*STYLE*/" not in body  # inlined: no other request, no CDN
    status, body = _get(f"{base}/snapshot", {"Authorization": f"Bearer {page.token}"})
    assert status == 200 and json.loads(body)["run_id"] == "phalanx-y"
    assert _get(f"{base}/nothing?token={page.token}")[0] == 404


def test_metrics_follow_prometheus_conventions(page: Dashboard) -> None:
    from prometheus_client.parser import text_string_to_metric_families

    status, body = _get(f"http://127.0.0.1:{page.port}/metrics?token={page.token}")
    assert status == 200
    families = {f.name: f for f in text_string_to_metric_families(body.decode())}
    assert families["phalanx_rank_steps"].type == "counter"
    assert families["phalanx_rank_collective_wait_seconds"].type == "counter"
    sample = families["phalanx_rank_steps"].samples[0]
    assert sample.name == "phalanx_rank_steps_total" and sample.value == 9
    assert sample.labels == {"job_id": "phalanx-y", "rank": "0", "host": "h1"}
    assert families["phalanx_rank_step_seconds"].samples[0].value == pytest.approx(0.25)
    assert {"phalanx_job_ranks_alive", "phalanx_job_reformations", "phalanx_rank_reduced_bytes",
            "phalanx_rank_start_latency_seconds", "phalanx_job_up"} <= set(families)


def test_the_event_stream_sends_the_board(page: Dashboard) -> None:
    with urllib.request.urlopen(page.url.replace("/?", "/events?"), timeout=10) as stream:
        assert stream.headers["Content-Type"] == "text/event-stream"
        line = stream.readline()
        assert line.startswith(b"data: ") and json.loads(line[6:])["ranks"][0]["steps"] == 9
        page.board.observe(_rec(1, 1.0, 3, 0.0))  # type: ignore[union-attr]
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            line = stream.readline()
            if line.startswith(b"data: ") and json.loads(line[6:])["ranks"][1]["steps"] == 3:
                break
        else:
            raise AssertionError("the stream did not send the board's change")
    page.drain(timeout_s=5)


def test_a_port_in_use_is_an_error_before_anything_starts(page: Dashboard) -> None:
    with pytest.raises(InvalidArgumentError, match=f"127.0.0.1:{page.port}"):
        Dashboard("127.0.0.1", page.port)


# --- MLflow, against a stand-in module


class _FakeClient:
    logged: list[tuple[str, str, float, int]] = []
    dicts: list[tuple[str, dict[str, Any], str]] = []

    def log_metric(self, run_id: str, key: str, value: float, timestamp: int = 0, step: int = 0) -> None:
        self.logged.append((run_id, key, value, step))

    def log_dict(self, run_id: str, data: dict[str, Any], path: str) -> None:
        self.dicts.append((run_id, data, path))


def _fake_mlflow(active: bool) -> Any:
    run = SimpleNamespace(info=SimpleNamespace(run_id="run-7")) if active else None
    return SimpleNamespace(active_run=lambda: run, tracking=SimpleNamespace(MlflowClient=_FakeClient))


def test_mlflow_gets_rank_0s_figures_and_the_summary() -> None:
    _FakeClient.logged, _FakeClient.dicts = [], []
    board = JobBoard("phalanx-z", 2)
    log = MlflowLog(_fake_mlflow(active=True), board)
    for obs in (_rec(0, 1.0, 10, 0.1), _rec(1, 1.0, 10, 0.1), _rec(0, 2.0, 30, 0.3), _rec(1, 2.0, 30, 0.3),
                JobEnded(True, "every rank finished; rank 0 returned 1")):
        board.observe(obs)  # type: ignore[arg-type]
        log.observe(obs)  # type: ignore[arg-type]
    log.close()
    steps = [(step, value) for run, key, value, step in _FakeClient.logged if key == "phalanx.steps"]
    assert steps == [(10, 10.0), (30, 30.0)]  # rank 0's only, not one series per rank
    assert {run for run, *_ in _FakeClient.logged} == {"run-7"}
    rate = [value for _, key, value, step in _FakeClient.logged if key == "phalanx.steps_per_s"]
    assert rate == [0.0, 20.0]
    assert ("run-7", "phalanx.job_succeeded", 1.0, 0) in _FakeClient.logged
    (_, summary, path), = _FakeClient.dicts
    assert path == "phalanx/timeline_summary.json" and summary["collectives"][0]["kind"] == "allreduce"


def test_mlflow_without_an_active_run_logs_nothing(caplog: pytest.LogCaptureFixture,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MLFLOW_RUN_ID", raising=False)
    _FakeClient.logged = []
    with caplog.at_level(logging.WARNING):
        log = MlflowLog(_fake_mlflow(active=False), JobBoard("j", 1))
    log.observe(_rec(0, 1.0, 1, 0.0))
    log.close()
    assert _FakeClient.logged == [] and "mlflow.start_run()" in caplog.text


# --- options


@pytest.mark.parametrize(("value", "where"), [
    (True, ("127.0.0.1", 0)), ("1", ("127.0.0.1", 0)), (8265, ("127.0.0.1", 8265)), ("8265", ("127.0.0.1", 8265)),
    ("0.0.0.0:9000", ("0.0.0.0", 9000)), ("[::1]:9000", ("::1", 9000)), (False, None), ("0", None), (None, None),
])
def test_dashboard_values(value: object, where: tuple[str, int] | None) -> None:
    assert options.parse_dashboard(value) == where


@pytest.mark.parametrize("value", ["70000", "abc", "host.invalid.:1", 1.5, -1])
def test_bad_dashboard_values_name_the_fix(value: object) -> None:
    with pytest.raises(InvalidArgumentError, match="dashboard"):
        options.parse_dashboard(value)


def test_options_come_from_the_environment_when_not_given(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PHALANX_DASHBOARD", "9100")
    assert options.resolve() == options.ObserveOptions(("127.0.0.1", 9100))
    assert options.resolve(dashboard=False) is None
    monkeypatch.delenv("PHALANX_DASHBOARD")
    assert options.resolve() is None
    with pytest.raises(InvalidArgumentError, match="pip install mlflow"):
        options.resolve(mlflow=True)


# --- the monitor's observer hook


def test_the_monitor_tells_an_observer_what_happens() -> None:
    seen: list[Observation] = []
    events: queue.Queue[Any] = queue.Queue()
    config = MonitorConfig(world_size=2, expect_results=True, expect_hello=True, start_timeout_s=30,
                           start_timeout_hint="x")
    monitor = JobMonitor(config, events, [], stop_all=lambda: None, observer=seen.append)
    for event in (Hello(0, 10, "h"), Hello(1, 11, "h"), LogLine(0, Stream.STDOUT, "hi"), _rec(0, 1.0, 1, 0.0),
                  ErrorRecord(1, "ValueError", "bad", "tb"), RankExit(1, 1), RankExit(0, -15)):
        events.put(event)
    with pytest.raises(WorkerFailedError):
        monitor.run()
    kinds = [type(o).__name__ for o in seen]
    assert kinds == ["RankStarted", "RankStarted", "LogLine", "RankStats", "RankEnded", "RankEnded", "JobEnded"]
    ended = [o for o in seen if isinstance(o, RankEnded)]
    assert ended[0] == RankEnded(1, 1, True, "ValueError: bad")
    assert ended[1].stopped and ended[1].returncode == -15  # ended by the teardown after rank 1's failure
    final = seen[-1]
    assert isinstance(final, JobEnded) and not final.ok and final.report.startswith("rank 1 ")
    assert "ValueError: bad" in final.report
    assert isinstance(seen[0], RankStarted) and seen[0].host == "h"


# --- a command's rank (no worker channel): hvd.init() connects for its stats


def test_a_commands_rank_reports_on_a_channel_of_its_own(monkeypatch: pytest.MonkeyPatch) -> None:
    from phalanx.job.channel import DriverChannel

    # white-box: a command rank's stats reporter, started inside hvd.init() (no public name)
    from phalanx.torch._setup import observe as _observe

    channel = DriverChannel(2, b"")
    try:
        for name, value in {"PHALANX_STATS_INTERVAL_S": "0.05", "PHALANX_CHANNEL": channel.address,
                            "PHALANX_SECRET": channel.secret, "RANK": "1", "WORLD_SIZE": "2",
                            "HOROVOD_HOSTNAME": "h7"}.items():
            monkeypatch.setenv(name, value)
        _observe.report_stats()
        stats.step()
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            event = channel.events.get(timeout=20)
            if isinstance(event, RankStats) and event.steps == 1:
                break
        else:
            raise AssertionError("no stats record with the step arrived")
        assert (event.rank, event.host) == (1, "h7")
    finally:
        stats.stop_reporter()
        channel.close()


# --- the entry points' switches


def test_phalanxrun_and_the_spark_spec_take_the_switches(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    from phalanx.cli.main import parse_config
    from phalanx.launch.core import JobSpec
    from phalanx.launch.local import LocalLauncher

    script = tmp_path / "train.py"
    script.write_text("print(1)\n")
    monkeypatch.delenv("PHALANX_DASHBOARD", raising=False)
    config = parse_config(["-np", "2", "--dashboard", "python", str(script)])
    assert config.observe == options.ObserveOptions(("127.0.0.1", 0))
    assert parse_config(["-np", "2", "--dashboard", "0.0.0.0:9200", "python", str(script)]).observe == \
        options.ObserveOptions(("0.0.0.0", 9200))
    assert parse_config(["-np", "2", "--dashboard", "9100", "python", str(script)]).observe == \
        options.ObserveOptions(("127.0.0.1", 9100))
    assert parse_config(["-np", "2", "python", str(script)]).observe is None
    # Every launcher's ranks get the stats interval; a user's own value wins.
    spec = LocalLauncher(JobSpec(np=2, command=("true",), observe=config.observe)).spec
    assert spec.env["PHALANX_STATS_INTERVAL_S"] == "1"
    assert "PHALANX_STATS_INTERVAL_S" not in LocalLauncher(JobSpec(np=2, command=("true",))).spec.env
    # HorovodRunner and TorchDistributor build their specs without the switch: the variable is their way in.
    assert JobSpec(np=2).observe is None
    monkeypatch.setenv("PHALANX_DASHBOARD", "9300")
    assert JobSpec(np=2).observe == options.ObserveOptions(("127.0.0.1", 9300))
