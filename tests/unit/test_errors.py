from __future__ import annotations

import pickle

import pytest

from phalanx import errors


def test_every_error_class_pickles() -> None:
    for cls in (errors.PhalanxError, errors.InvalidArgumentError, errors.PayloadError, errors.StartTimeoutError,
                errors.ChannelError, errors.WorkerContractError, errors.JobAbortedError):
        err = cls("boom")
        back = pickle.loads(pickle.dumps(err))
        assert type(back) is cls and str(back) == "boom"
        assert isinstance(back, errors.PhalanxError)


def test_worker_failed_error_is_one_report_root_cause_first() -> None:
    root = errors.RankFailure(rank=1, summary="ValueError: bad", traceback="Traceback...\nValueError: bad\n",
                              log_tail=("line a", "line b"), exc_type="ValueError", host="h1",
                              where="/u/train.py:5 in step")
    later = errors.RankFailure(rank=2, summary="ConnectionError: peer gone", host="h2", traceback="tb",
                               where="/u/train.py:9 in main")
    stopped = errors.RankFailure(rank=0, summary="process ended with signal SIGTERM (15)", returncode=-15,
                                 secondary=True)
    err = errors.WorkerFailedError([root, later, stopped])
    text = str(err)
    lines = text.splitlines()
    assert lines[0] == "rank 1 [on host h1] failed at /u/train.py:5 in step: ValueError: bad"
    assert lines[1:3] == ["  Traceback...", "  ValueError: bad"] and "line b" not in text  # not the tail
    assert "After it: rank 2 [on host h2] failed too at /u/train.py:9 in main: ConnectionError: peer gone" in lines
    assert lines[-1] == "Stopped by phalanx after the root cause (not failed): rank(s) 0"
    assert text.count("Traceback") == 1 and "tb" not in lines  # one traceback: the root cause's
    back = pickle.loads(pickle.dumps(err))
    assert back.failures == err.failures and str(back) == text
    assert err.exit_code == 1


def test_a_traceback_the_console_showed_is_not_printed_again() -> None:
    shown = errors.RankFailure(rank=0, summary="KeyError: 'x'", traceback="Traceback...\nKeyError: 'x'\n",
                               traceback_shown=True)
    assert str(errors.WorkerFailedError([shown])).splitlines()[1:] == ["  (rank 0's traceback is above, in its output)"]
    died = errors.RankFailure(rank=0, summary="process ended with signal SIGKILL (9)", log_tail=("last words",))
    assert "Last 1 log lines of rank 0:\n    last words" in str(errors.WorkerFailedError([died]))


@pytest.mark.parametrize(("rc", "text", "shell"), [(3, "exit code 3", 3), (-9, "signal SIGKILL (9)", 137)])
def test_exit_descriptions(rc: int, text: str, shell: int) -> None:
    assert errors.describe_exit(rc) == text
    assert errors.shell_exit_code(rc) == shell
    assert errors.WorkerFailedError([errors.RankFailure(rank=0, summary="x", returncode=rc)]).exit_code == shell


def test_invalid_argument_is_a_value_error() -> None:
    assert issubclass(errors.InvalidArgumentError, ValueError)
    assert issubclass(errors.StartTimeoutError, TimeoutError)
    assert issubclass(errors.WorkerFailedError, RuntimeError)
