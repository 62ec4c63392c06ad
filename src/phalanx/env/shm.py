"""The names of the shared-memory transport's files (``/dev/shm``), known to the transport that makes them
and to the launcher that removes a killed job's leftovers."""

from __future__ import annotations

import os
import re
import stat
from collections.abc import Iterable

SHM_DIR = "/dev/shm"
PREFIX = "phalanx-shm-"
#: Every name the transport makes (a segment, or a wake-up FIFO with ``.wake``); a name read from the
#: store must match it before it becomes a path, so no store value can point outside ``/dev/shm``.
NAME_PATTERN = re.compile(r"phalanx-shm-[0-9]+-[0-9a-f]{12}(\.wake)?")


def remove_named(values: Iterable[bytes]) -> list[str]:
    """Remove the transport's files named by ``values`` (a job's store values) that still exist, are this
    user's and are not links; return the names removed. Other values are ignored."""
    removed = []
    for value in values:
        name = value.decode("ascii", "replace")
        if not NAME_PATTERN.fullmatch(name):
            continue
        path = os.path.join(SHM_DIR, name)
        try:
            info = os.lstat(path)
            if stat.S_ISLNK(info.st_mode) or info.st_uid != os.geteuid():
                continue
            os.unlink(path)
            removed.append(name)
        except OSError:
            continue  # already gone: the ranks removed it
    return removed
