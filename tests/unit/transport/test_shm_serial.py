"""The transport worker thread (``transport/_serial.py``) without processes: order, inline calls, errors, close."""

from __future__ import annotations

import threading
from datetime import timedelta

import pytest

# white-box: the transport's serial worker, internal (no public name)
from phalanx.transport._serial import Serial


def test_calls_run_in_order_off_the_caller_thread_with_inline_calls_in_the_waiter() -> None:
    worker, ran = Serial("test"), []
    release = threading.Event()
    first = worker.call(lambda: (release.wait(5), ran.append(("a", threading.current_thread().name))))
    inline = worker.call(lambda: ran.append(("b", threading.current_thread().name)), inline=True)
    after = worker.call(lambda: ran.append(("c", threading.current_thread().name)))
    with pytest.raises(RuntimeError, match="not started within"):
        inline.wait(timedelta(milliseconds=50))  # "a" still runs: like gloo work, a time-out raises
    release.set()
    assert inline.wait() and after.wait(5.0) and first.is_completed()
    me = threading.current_thread().name
    assert [k for k, _ in ran] == ["a", "b", "c"]
    assert ran[0][1] != me and ran[1][1] == me and ran[2][1] != me
    assert worker.close(timeout_s=5.0)


def test_an_error_reaches_the_waiter_and_later_calls_still_run() -> None:
    worker = Serial("test")

    def boom() -> None:
        raise ValueError("peer gone")

    failed, ok = worker.call(boom), worker.call(lambda: None)
    with pytest.raises(ValueError, match="peer gone"):
        failed.wait()
    assert ok.wait(5.0)
    assert worker.close(timeout_s=5.0)


def test_close_releases_a_worker_held_by_an_inline_call_nobody_waits_for() -> None:
    worker = Serial("test")
    gate = worker.call(lambda: None, inline=True)  # e.g. a step abandoned after a failure
    assert gate.reached.wait(30), "the worker did not reach the inline call's gate within 30 s"  # type: ignore[attr-defined]
    assert worker.close(timeout_s=5.0)  # the gate never opens by itself: only close() can end the worker
