"""Tie a worker's life to its launcher's: when the launcher dies, the worker is killed by the kernel."""

from __future__ import annotations

import ctypes
import os
import signal
import sys

from phalanx.env import settings

_PR_SET_PDEATHSIG = 1
_PR_SET_NAME = 15
#: Exit code when the launcher was already gone before the lifeline was tied.
EXIT_ORPHANED = 143


def die_with_parent() -> None:
    """Ask the kernel (Linux) to SIGKILL this process when its parent dies; exit if it already did.

    The launcher passes its pid in ``PHALANX_PARENT_PID``; comparing it with ``getppid()`` after the
    ``prctl`` closes the race of a parent that died before the call. A no-op on other systems.
    """
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
    except (OSError, AttributeError):
        return
    expected = settings.PARENT_PID.get()
    if expected is not None and os.getppid() != expected:
        os._exit(EXIT_ORPHANED)


def set_process_name(name: str) -> None:
    """Set this process's kernel name (``/proc/<pid>/comm``; Linux, at most 15 bytes); a no-op elsewhere."""
    if not sys.platform.startswith("linux"):
        return
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_NAME, ctypes.c_char_p(name.encode()[:15]), 0, 0, 0)
    except (OSError, AttributeError):
        return
