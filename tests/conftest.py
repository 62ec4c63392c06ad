"""Fixtures shared by every tier.

``no_leftover_processes`` is autouse: a test fails when it leaves a child process (or zombie) of the
test process behind that was not there before it started. Fixtures that must outlive a test (a Spark
session, a standalone cluster) start their processes before the test's snapshot, so they are not counted.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator

import pytest

from phalanx.launch import warm
from phalanx.launch.proctree import descendants, is_alive

LEFTOVER_WAIT_S = 10.0


def _live_descendants() -> set[int]:
    # The warm-start template outlives jobs by design (it is checked at the end of the session); the
    # ranks it forks are its children and are counted.
    live = {p for p in descendants(os.getpid()) if is_alive(p) or _is_zombie(p)}
    return live - warm.template_pids()


def _is_zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            raw = f.read()
    except OSError:
        return False
    return raw[raw.rfind(")") + 2 :].split()[0] == "Z"


def _describe(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmd = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        cmd = "?"
    state = "zombie" if _is_zombie(pid) else "alive"
    return f"pid {pid} ({state}): {cmd[:200]}"


@pytest.fixture(autouse=True)
def no_leftover_processes() -> Iterator[None]:
    """Fail the test if it leaves child processes behind (waits up to LEFTOVER_WAIT_S for them to go)."""
    before = _live_descendants()
    yield
    deadline = time.monotonic() + LEFTOVER_WAIT_S
    left = _live_descendants() - before
    while left and time.monotonic() < deadline:
        time.sleep(0.1)
        left = _live_descendants() - before
    if left:
        pytest.fail("test left processes behind:\n" + "\n".join(_describe(p) for p in sorted(left)))


@pytest.fixture(scope="session", autouse=True)
def warm_template_is_shut_down() -> Iterator[None]:
    """At the end of the session, stopping the warm-start template leaves no process behind."""
    before = {p for p in descendants(os.getpid()) if is_alive(p)}
    yield
    warm.shutdown()
    deadline = time.monotonic() + LEFTOVER_WAIT_S
    while (left := {p for p in descendants(os.getpid()) if is_alive(p)} - before) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not left, "warm-start template left processes: " + ", ".join(_describe(p) for p in sorted(left))
