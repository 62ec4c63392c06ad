"""Horovod's knobs a rank reads (what phalanxrun's --log-level, --gloo-timeout-seconds, --stall-check* set)."""

from __future__ import annotations

import io
import logging
from collections.abc import Iterator
from datetime import timedelta

import pytest

from phalanx.errors import HorovodInternalError

# white-box: how each Horovod knob is read, inside hvd.init(): internal (no public name)
from phalanx.torch._health import stall as _stall
from phalanx.torch._runtime import RUNTIME, Inspector
from phalanx.torch._setup import log as _log
from phalanx.torch._setup.state import gloo_timeout


@pytest.fixture
def phalanx_logger() -> Iterator[logging.Logger]:
    logger = logging.getLogger("phalanx")
    saved = (logger.level, list(logger.handlers), logger.propagate)
    yield logger
    logger.setLevel(saved[0])
    logger.handlers[:] = saved[1]
    logger.propagate = saved[2]


def test_log_knobs_unset_leave_logging_alone(phalanx_logger: logging.Logger) -> None:
    before = (phalanx_logger.level, list(phalanx_logger.handlers), phalanx_logger.propagate)
    assert _log.configure({}) is None
    assert (phalanx_logger.level, list(phalanx_logger.handlers), phalanx_logger.propagate) == before


def test_log_level_and_horovods_line_layout(phalanx_logger: logging.Logger) -> None:
    handler = _log.configure({"HOROVOD_LOG_LEVEL": "info"})
    assert isinstance(handler, logging.StreamHandler)
    assert phalanx_logger.level == logging.INFO and not phalanx_logger.propagate
    out = io.StringIO()
    handler.setStream(out)
    logging.getLogger("phalanx.torch.x").info("hello")
    logging.getLogger("phalanx.torch.x").debug("not shown")
    line = out.getvalue()
    assert line.startswith("[20") and line.endswith(" I phalanx.torch.x] hello\n") and "not shown" not in line
    assert _log.configure({"HOROVOD_LOG_LEVEL": "TRACE", "HOROVOD_LOG_HIDE_TIME": "1"}) is handler  # idempotent
    assert phalanx_logger.level == logging.DEBUG
    out.truncate(0)
    out.seek(0)
    logging.getLogger("phalanx.y").warning("no time")
    assert out.getvalue() == "[W phalanx.y] no time\n"


def test_bad_log_level_is_named(phalanx_logger: logging.Logger) -> None:
    with pytest.raises(ValueError, match="HOROVOD_LOG_LEVEL='LOUD' is not one of"):
        _log.configure({"HOROVOD_LOG_LEVEL": "LOUD"})


def test_gloo_timeout() -> None:
    assert gloo_timeout({}) is None
    assert gloo_timeout({"HOROVOD_GLOO_TIMEOUT_SECONDS": "45"}) == timedelta(seconds=45)
    for bad in ("soon", "0", "-3"):
        with pytest.raises(ValueError, match="HOROVOD_GLOO_TIMEOUT_SECONDS"):
            gloo_timeout({"HOROVOD_GLOO_TIMEOUT_SECONDS": bad})


@pytest.mark.parametrize(
    ("env", "check_s"),
    [
        ({}, _stall.DEFAULT_CHECK_S),
        ({"HOROVOD_STALL_CHECK_TIME_SECONDS": "60"}, 60.0),
        ({"HOROVOD_STALL_CHECK_DISABLE": "1", "HOROVOD_STALL_CHECK_TIME_SECONDS": "60"}, 0.0),
        ({"HOROVOD_STALL_CHECK_DISABLE": "0", "HOROVOD_STALL_CHECK_TIME_SECONDS": "7"}, 7.0),
        ({"PHALANX_STALL_CHECK_S": "2", "HOROVOD_STALL_CHECK_DISABLE": "1"}, 2.0),
    ],
)
def test_stall_check_seconds(monkeypatch: pytest.MonkeyPatch, env: dict[str, str], check_s: float) -> None:
    for name in ("PHALANX_STALL_CHECK_S", "HOROVOD_STALL_CHECK_DISABLE", "HOROVOD_STALL_CHECK_TIME_SECONDS"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert _stall.check_interval() == check_s


@pytest.mark.parametrize(
    ("env", "warn_s"),
    [
        ({}, 60.0),  # Horovod's default; the inspector's own 5 s are silent
        ({"HOROVOD_STALL_CHECK_TIME_SECONDS": "10"}, 10.0),
        ({"HOROVOD_STALL_CHECK_DISABLE": "1", "HOROVOD_STALL_CHECK_TIME_SECONDS": "10"}, 0.0),
    ],
)
def test_stall_warning_seconds(monkeypatch: pytest.MonkeyPatch, env: dict[str, str], warn_s: float) -> None:
    for name in ("HOROVOD_STALL_CHECK_DISABLE", "HOROVOD_STALL_CHECK_TIME_SECONDS"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert _stall.warn_after() == warn_s


def test_stall_shutdown_seconds(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("HOROVOD_STALL_SHUTDOWN_TIME_SECONDS", raising=False)
    assert _stall.shutdown_after() == 0.0
    monkeypatch.setenv("HOROVOD_STALL_SHUTDOWN_TIME_SECONDS", "30")
    assert _stall.shutdown_after() == 30.0
    monkeypatch.setenv("HOROVOD_STALL_SHUTDOWN_TIME_SECONDS", "later")
    with pytest.raises(ValueError, match="HOROVOD_STALL_SHUTDOWN_TIME_SECONDS='later'"):
        _stall.shutdown_after()


def test_a_stalled_wait_warns_once_then_gives_up_at_the_shutdown_time(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    inspector = Inspector()
    inspector.check_s, inspector.warn_s, inspector.shutdown_s = 1.0, 2.0, 4.0
    withdrawn: list[str] = []
    inspector.store = type("Store", (), {"set": lambda self, key, value: withdrawn.append(key)})()
    published: list[float] = []

    def stalled(wait: dict[str, object]) -> None:
        published.append(1.0)
        inspector.mine = _stall.Record(0)  # published: the warning is not repeated

    monkeypatch.setattr(_stall, "stalled", stalled)
    monkeypatch.setattr(RUNTIME, "inspector", inspector)
    monkeypatch.setattr(_stall, "current_wait", lambda: {"ranks": (0, 1), "kind": "allreduce", "name": "grad"})
    with caplog.at_level(logging.WARNING, logger="phalanx.torch._health.stall"):
        assert _stall.on_stall(0.5) is None  # not yet stalled
        assert _stall.on_stall(1.0) is None  # inspected, silently
        assert _stall.on_stall(2.0) is None and _stall.on_stall(3.0) is None  # warned once
        error = _stall.on_stall(4.0)
    assert len(published) == 3
    assert [r.getMessage() for r in caplog.records if "stall check" in r.getMessage()] == [
        "stall check: allreduce 'grad' on ranks [0, 1] has waited 2 s for the other ranks (rank 0; "
        "HOROVOD_STALL_CHECK_TIME_SECONDS): the ranks missing from it could not be read from the job's store"]
    assert withdrawn == ["rec/0"] and inspector.mine is None  # the record is withdrawn as the rank gives up
    assert isinstance(error, HorovodInternalError)
    assert "waited 4 s, past HOROVOD_STALL_SHUTDOWN_TIME_SECONDS=4" in str(error)
    assert not inspector.warned  # the next wait is warned about afresh


def test_shutdown_below_the_warning_time_is_ignored_as_in_horovod(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.delenv("HOROVOD_STALL_CHECK_DISABLE", raising=False)
    monkeypatch.setenv("HOROVOD_STALL_CHECK_TIME_SECONDS", "60")
    monkeypatch.setenv("HOROVOD_STALL_SHUTDOWN_TIME_SECONDS", "30")
    monkeypatch.setattr(RUNTIME, "inspector", Inspector())
    with caplog.at_level(logging.WARNING, logger="phalanx.torch._health.stall"):
        _stall.start(lambda: ({}, {}))
    assert RUNTIME.inspector.shutdown_s == 0.0 and "will not be shut down" in caplog.text
    monkeypatch.setenv("HOROVOD_STALL_SHUTDOWN_TIME_SECONDS", "90")
    _stall.start(lambda: ({}, {}))
    assert RUNTIME.inspector.shutdown_s == 90.0
