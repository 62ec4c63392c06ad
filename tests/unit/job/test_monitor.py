from __future__ import annotations

import io
import queue

import cloudpickle
import pytest

from phalanx.errors import StartTimeoutError, WorkerFailedError
from phalanx.job.channel import Result
from phalanx.job.monitor import JobMonitor, MonitorConfig, RankExit
from phalanx.job.progress import Progress
from phalanx.job.records import ErrorRecord, Hello, LogLine, Stream


def _monitor(events: list[object], n: int = 2, **kw: object) -> tuple[JobMonitor, list[str]]:
    q: queue.Queue[object] = queue.Queue()
    for e in events:
        q.put(e)
    stops: list[str] = []
    cfg = MonitorConfig(world_size=n, expect_results=True, expect_hello=True, start_timeout_s=5,
                        start_timeout_hint="start_timeout=", stop_wait_s=0.5)
    for k, v in kw.items():
        cfg = MonitorConfig(**{**cfg.__dict__, k: v})  # type: ignore[arg-type]
    return JobMonitor(cfg, q, [], stop_all=lambda: stops.append("stop")), stops  # type: ignore[arg-type]


def test_results_in_rank_order_whatever_the_arrival_order() -> None:
    events = [Hello(1, 11, "h"), Hello(0, 10, "h"), Result(1, cloudpickle.dumps("one")), RankExit(1, 0),
              Result(0, cloudpickle.dumps("zero")), RankExit(0, 0)]
    mon, stops = _monitor(events)
    assert mon.run() == ["zero", "one"]
    assert stops == []


def test_first_failure_is_root_cause_and_others_follow() -> None:
    err = ErrorRecord(rank=1, exc_type="ValueError", message="bad input", traceback="Traceback\nValueError\n")
    events = [Hello(0, 1, "h"), Hello(1, 2, "h"), LogLine(1, Stream.STDOUT, "about to fail"), err,
              RankExit(1, 1), RankExit(0, -15)]
    mon, stops = _monitor(events)
    with pytest.raises(WorkerFailedError) as info:
        mon.run()
    failures = info.value.failures
    assert [f.rank for f in failures] == [1, 0]
    assert failures[0].summary == "ValueError: bad input" and failures[0].log_tail == ("about to fail",)
    assert failures[1].secondary
    assert stops == ["stop"]


def test_the_root_cause_is_the_rank_that_died_first_not_the_first_heard_of() -> None:
    """A SIGKILLed rank's exit is posted after its output is drained; the survivor's error about the lost
    peer can arrive first. The rank whose process ended first is the root cause, and it is not listed as
    stopped by phalanx."""
    import time

    died = time.monotonic() - 5.0
    err = ErrorRecord(rank=0, exc_type="ShmTransportError", message="peer rank 1 is gone", traceback="")
    events = [Hello(0, 1, "h"), Hello(1, 2, "h"), err, RankExit(0, 1), RankExit(1, -9, ended_at=died)]
    mon, _ = _monitor(events)
    with pytest.raises(WorkerFailedError) as info:
        mon.run()
    failures = info.value.failures
    assert [f.rank for f in failures] == [1, 0]
    assert failures[0].summary == "process ended with signal SIGKILL (9)" and not failures[0].secondary
    assert failures[1].summary == "ShmTransportError: peer rank 1 is gone"


def test_a_rank_named_dead_by_the_first_error_is_the_root_cause_even_if_its_exit_is_dated_later() -> None:
    """Under load a survivor's shared-memory error about its dead peer can be heard, and dated, before the
    dead rank's exit (a SIGABRT that takes a while: core dump, torch's abort handler). The error names the
    peer; that rank is the root cause, also when its own error is heard after the survivor's."""
    from phalanx.errors import PEER_DIED

    message = f"allreduce 'grad' cannot complete: peer rank 1 (pid 4242) {PEER_DIED} before reaching it"
    err = ErrorRecord(rank=0, exc_type="phalanx.errors.ShmTransportError", message=message, traceback="")
    events = [Hello(0, 1, "h"), Hello(1, 2, "h"), Hello(2, 3, "h"), err, RankExit(0, 1), RankExit(2, -15),
              RankExit(1, -6)]
    mon, _ = _monitor(events, n=3)
    with pytest.raises(WorkerFailedError) as info:
        mon.run()
    failures = info.value.failures
    assert [f.rank for f in failures] == [1, 0, 2]
    assert failures[0].summary == "process ended with signal SIGABRT (6)" and not failures[0].secondary
    assert not failures[1].secondary and failures[2].secondary

    own = ErrorRecord(rank=1, exc_type="ValueError", message="bad batch", traceback="")
    events = [Hello(0, 1, "h"), Hello(1, 2, "h"), err, own, RankExit(0, 1), RankExit(1, 1)]
    mon, _ = _monitor(events)
    with pytest.raises(WorkerFailedError) as info:
        mon.run()
    assert [f.rank for f in info.value.failures] == [1, 0]
    assert info.value.failures[0].summary == "ValueError: bad batch"


def test_exit_zero_without_result_is_a_failure() -> None:
    mon, _ = _monitor([Hello(0, 1, "h"), RankExit(0, 0)], n=1)
    with pytest.raises(WorkerFailedError, match="without reporting a result"):
        mon.run()


def test_signal_death_is_named() -> None:
    mon, _ = _monitor([Hello(0, 1, "h"), RankExit(0, -9)], n=1)
    with pytest.raises(WorkerFailedError, match=r"signal SIGKILL \(9\)"):
        mon.run()


def test_a_failed_rank_is_named_on_the_host_its_hello_gave_when_the_launcher_placed_none() -> None:
    # Spark places the ranks: the driver's host is not theirs
    mon, _ = _monitor([Hello(0, 1, "10.0.0.7"), Hello(1, 2, "10.0.0.8"), RankExit(1, -9)])
    with pytest.raises(WorkerFailedError, match=r"^rank 1 \[on host 10\.0\.0\.8\] failed: process ended with "
                                                r"signal SIGKILL"):
        mon.run()


def test_start_timeout_names_missing_ranks_and_knob() -> None:
    mon, stops = _monitor([Hello(0, 1, "h")], n=3, start_timeout_s=0.2)
    expected = r"rank\(s\) 1, 2 of 3 did not start within 0.2 s; raise start_timeout="
    with pytest.raises(StartTimeoutError, match=expected):
        mon.run()
    assert stops == ["stop"]


class _Terminal(io.StringIO):
    """A stream that says it is a terminal (progress then updates one line)."""

    def isatty(self) -> bool:
        return True


def test_progress_counts_the_ranks_started_and_erases_its_terminal_line() -> None:
    plain, tty = io.StringIO(), _Terminal()
    for stream in (plain, tty):
        progress = Progress(stream=stream)
        progress.step("waiting for 2 barrier task(s)")
        progress.step("ranks started 1/2")
        progress.step("ranks started 1/2")  # repeats say nothing
        progress.clear()
    assert plain.getvalue() == "phalanx: waiting for 2 barrier task(s)\nphalanx: ranks started 1/2\n"
    assert tty.getvalue() == ("\r\033[Kphalanx: waiting for 2 barrier task(s)\r\033[Kphalanx: ranks started 1/2"
                              "\r\033[K")
    quiet = io.StringIO()
    Progress(enabled=False, stream=quiet).step("x")
    assert quiet.getvalue() == ""


def test_progress_counts_once_complete_off_a_terminal_and_says_nothing_once_finished() -> None:
    plain, tty = io.StringIO(), _Terminal()
    for stream in (plain, tty):
        progress = Progress(stream=stream)
        for k in range(4):
            progress.count("ranks started", k, 3)
        progress.finish()
        progress.step("a replacement rank started")  # after the start: nothing
    assert plain.getvalue() == "phalanx: ranks started 3/3\n"
    assert tty.getvalue() == "".join(f"\r\033[Kphalanx: ranks started {k}/3" for k in range(4)) + "\r\033[K"
    silent = io.StringIO()
    Progress(enabled=False, stream=silent).count("ranks started", 3, 3)
    assert silent.getvalue() == ""
