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


def test_worker_failed_error_message_and_pickling() -> None:
    root = errors.RankFailure(rank=1, summary="ValueError: bad", traceback="Traceback...\nValueError: bad\n",
                         log_tail=("line a", "line b"), exc_type="ValueError")
    stopped = errors.RankFailure(rank=0, summary="process ended with signal SIGTERM (15)", returncode=-15,
                            secondary=True)
    err = errors.WorkerFailedError([root, stopped])
    text = str(err)
    assert text.startswith("rank 1 failed: ValueError: bad")
    assert "Traceback from rank 1" in text and "line b" in text
    assert "Stopped by phalanx after the root cause: rank(s) 0" in text
    back = pickle.loads(pickle.dumps(err))
    assert back.failures == err.failures and str(back) == text
    assert err.exit_code == 1


@pytest.mark.parametrize(("rc", "text", "shell"), [(3, "exit code 3", 3), (-9, "signal SIGKILL (9)", 137)])
def test_exit_descriptions(rc: int, text: str, shell: int) -> None:
    assert errors.describe_exit(rc) == text
    assert errors.shell_exit_code(rc) == shell
    assert errors.WorkerFailedError([errors.RankFailure(rank=0, summary="x", returncode=rc)]).exit_code == shell


def test_invalid_argument_is_a_value_error() -> None:
    assert issubclass(errors.InvalidArgumentError, ValueError)
    assert issubclass(errors.StartTimeoutError, TimeoutError)
    assert issubclass(errors.WorkerFailedError, RuntimeError)
