"""Another local user for the job layer's attack tests: code run as uid/gid 65534 in a forked child."""

from __future__ import annotations

import os
from collections.abc import Callable

NOBODY = 65534


def as_nobody(fn: Callable[[], int | None]) -> int:
    """Run ``fn`` in a forked child that has become uid/gid :data:`NOBODY`; the child's exit code: ``fn``'s
    (None: 0), 98 when the switch of user did not take, 99 when ``fn`` raised."""
    pid = os.fork()
    if pid == 0:
        code = 99
        try:
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            code = (fn() or 0) if os.getuid() == NOBODY else 98
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)
