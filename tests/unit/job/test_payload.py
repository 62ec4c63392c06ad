from __future__ import annotations

import threading

import pytest

from phalanx.errors import PayloadError
from phalanx.job.payload import find_unpicklable, load_call, serialize_call


def test_round_trip_of_a_closure() -> None:
    k = 5

    def add(x: int) -> int:
        return x + k

    call = load_call(serialize_call(add, (1,), {}))
    assert call.fn(*call.args, **call.kwargs) == 6


def test_lock_captured_in_closure_is_named() -> None:
    lock = threading.Lock()

    def uses_lock() -> None:
        with lock:
            pass

    with pytest.raises(PayloadError, match=r"fn closure variable 'lock' \(a _thread.lock\)"):
        serialize_call(uses_lock, (), {})


def test_unpicklable_argument_is_named() -> None:
    class Holder:
        def __init__(self) -> None:
            self.inner = {"h": threading.Lock()}

    with pytest.raises(PayloadError, match=r"kwargs\['cfg'\]\.inner\['h'\]"):
        serialize_call(print, (), {"cfg": Holder()})


def test_not_callable() -> None:
    with pytest.raises(PayloadError, match="fn must be callable"):
        serialize_call(42, (), {})  # type: ignore[arg-type]


def test_find_unpicklable_none_for_plain_data() -> None:
    assert find_unpicklable({"a": [1, 2.0, "x"]}, "args[0]") is None
