"""Waiting for a state in a test without a fixed sleep: poll a condition up to a deadline.

The deadline bounds a wait that should end long before it (it is generous: the tests run under heavy load),
and the failure names it, so a hang reads as "X did not happen within N s", never as a pytest timeout.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path

from phalanx.launch.proctree import is_alive

POLL_S = 0.05


def wait_until(condition: Callable[[], object], timeout_s: float, what: str, poll_s: float = POLL_S) -> None:
    """Return once ``condition()`` is true; fail with ``what`` and the timeout if it is not within ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout_s:g} s")
        time.sleep(poll_s)


def wait_gone(pid: int, timeout_s: float, what: str) -> None:
    """Return once process ``pid`` is gone from /proc (reaped); fail naming ``what`` and the timeout if not."""
    wait_until(lambda: not os.path.exists(f"/proc/{pid}"), timeout_s, f"{what} (pid {pid}) ended")


def end_rank_0_last(folder: str, timeout_s: float = 60.0) -> None:
    """In a rank of a 2-rank job: make rank 0 end after rank 1, by a handshake. Rank 1 leaves its pid in
    ``folder`` (written whole) and goes on; rank 0 waits until that process has ended, up to ``timeout_s``."""
    rank, pidfile = os.environ["RANK"], Path(folder, "rank1.pid")
    if rank == "1":
        Path(folder, "rank1.part").write_text(str(os.getpid()))
        os.replace(Path(folder, "rank1.part"), pidfile)
    elif rank == "0":
        wait_until(lambda: pidfile.exists() and not is_alive(int(pidfile.read_text())), timeout_s, "rank 1 ended")
