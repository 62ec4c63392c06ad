"""Fixtures shared by every tier.

``no_leftover_processes`` is autouse: a test fails when it leaves a child process (or zombie) of the
test process behind that was not there before it started. Fixtures that must outlive a test (a Spark
session, a standalone cluster) start their processes before the test's snapshot, so they are not counted;
a tier whose infrastructure legitimately starts long-lived processes overrides ``process_is_expected``.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator

import pytest

from phalanx.launch import warm
from phalanx.launch.proctree import cmdline, descendants, is_alive, is_zombie

LEFTOVER_WAIT_S = 10.0


def live_descendants(expected: Callable[[int], bool] = lambda pid: False) -> set[int]:
    """This process's live or zombie descendants, without the warm-start template and expected ones.

    The warm-start template outlives jobs by design (it is checked at the end of the session); the ranks
    it forks are its children and are counted.
    """
    live = {p for p in descendants(os.getpid()) if (is_alive(p) or is_zombie(p)) and not expected(p)}
    return live - warm.template_pids()


def describe(pid: int) -> str:
    """``pid 12 (zombie): cmd`` for failure messages."""
    state = "zombie" if is_zombie(pid) else "alive"
    return f"pid {pid} ({state}): {cmdline(pid)[:200] or '?'}"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """A Spark test's timeout bounds the test itself, not its fixtures. The first test of a module starts a
    JVM (a session, the standalone cluster, a Connect server) and its python workers in its setup; on a loaded
    host that takes minutes, and it must not eat into the test's own time. The cluster's start has its own
    bound (SPARK_START_TIMEOUT_S); make test's runner bounds each tier as a whole (tools/test_tiers.py)."""
    default = float(config.getini("timeout") or 0)
    for item in items:
        if item.get_closest_marker("spark") is None:
            continue
        marker = item.get_closest_marker("timeout")
        seconds = marker.kwargs.get("timeout", marker.args[0] if marker.args else default) if marker else default
        item.add_marker(pytest.mark.timeout(seconds, func_only=True), append=False)


@pytest.fixture
def process_is_expected() -> Callable[[int], bool]:
    """Processes a tier's own infrastructure keeps alive between tests (none by default)."""
    return lambda pid: False


@pytest.fixture(autouse=True)
def no_leftover_processes(process_is_expected: Callable[[int], bool]) -> Iterator[None]:
    """Fail the test if it leaves child processes behind (waits up to LEFTOVER_WAIT_S for them to go)."""
    before = live_descendants(process_is_expected)
    yield
    deadline = time.monotonic() + LEFTOVER_WAIT_S
    left = live_descendants(process_is_expected) - before
    while left and time.monotonic() < deadline:
        time.sleep(0.1)
        left = live_descendants(process_is_expected) - before
    if left:
        pytest.fail("test left processes behind:\n" + "\n".join(describe(p) for p in sorted(left)))


@pytest.fixture(scope="session", autouse=True)
def warm_template_is_shut_down() -> Iterator[None]:
    """At the end of the session, stopping the warm-start template leaves no process behind."""
    before = {p for p in descendants(os.getpid()) if is_alive(p)}
    yield
    warm.shutdown()
    deadline = time.monotonic() + LEFTOVER_WAIT_S
    while (left := {p for p in descendants(os.getpid()) if is_alive(p)} - before) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not left, "warm-start template left processes: " + ", ".join(describe(p) for p in sorted(left))
