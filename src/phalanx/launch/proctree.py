"""Process trees on this host: find a process's descendants and stop them all.

A worker may start its own children (a DataLoader's workers, a shell's commands) and some of them may
leave the worker's process group with ``setsid``; so teardown signals the process group *and* every
descendant found through ``/proc``. A daemon whose parent rank already exited is no longer anyone's
descendant (it was re-parented to init), so teardown also sweeps every process whose environment carries
the job's marker variable (each rank's ``PHALANX_RUN_ID``, which children inherit) - the way CI servers
find the processes of a build. On systems without ``/proc`` only the process group is signalled.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterable
from pathlib import Path

from phalanx.env.contract import process_name

_PROC = Path("/proc")


def _parent_and_state(pid: int) -> tuple[int, str] | None:
    try:
        raw = (_PROC / str(pid) / "stat").read_text()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    # The command name may contain spaces and parentheses: split after the last ')'.
    fields = raw[raw.rfind(")") + 2 :].split()
    return int(fields[1]), fields[0]


def parent_of(pid: int) -> int | None:
    """The parent pid of ``pid``, or None when it is gone."""
    info = _parent_and_state(pid)
    return info[0] if info else None


def is_zombie(pid: int) -> bool:
    """True when ``pid`` has exited but was not reaped yet."""
    info = _parent_and_state(pid)
    return info is not None and info[1] == "Z"


def cmdline(pid: int) -> str:
    """The command line of ``pid`` (empty when it is gone), for messages."""
    try:
        return (_PROC / str(pid) / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def children_map() -> dict[int, list[int]]:
    """Map every live pid to its direct children (empty when ``/proc`` is absent)."""
    tree: dict[int, list[int]] = {}
    if not _PROC.is_dir():
        return tree
    for entry in os.scandir(_PROC):
        if not entry.name.isdigit():
            continue
        info = _parent_and_state(int(entry.name))
        if info is not None:
            tree.setdefault(info[0], []).append(int(entry.name))
    return tree


def descendants(pid: int) -> list[int]:
    """Every descendant of ``pid`` (children first, then theirs), not including ``pid``."""
    tree = children_map()
    found: list[int] = []
    frontier = [pid]
    while frontier:
        kids = tree.get(frontier.pop(), [])
        found.extend(kids)
        frontier.extend(kids)
    return found


def processes_with_env(key: str, value: str) -> list[int]:
    """Pids of this user's processes whose initial environment has ``key=value`` (not this process)."""
    if not _PROC.is_dir():
        return []
    needle = f"{key}={value}".encode()
    found: list[int] = []
    for entry in os.scandir(_PROC):
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            environ = (_PROC / entry.name / "environ").read_bytes()
        except OSError:
            continue
        if needle in environ.split(b"\0"):
            found.append(int(entry.name))
    return found


def processes_named(name: str) -> list[int]:
    """Pids of this user's processes whose kernel name (``/proc/<pid>/comm``) is ``name`` (not this one)."""
    if not _PROC.is_dir():
        return []
    found: list[int] = []
    for entry in os.scandir(_PROC):
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if (_PROC / entry.name / "comm").read_text().rstrip("\n") == name and _owned(entry.name):
                found.append(int(entry.name))
        except OSError:
            continue
    return found


def _owned(pid: str) -> bool:
    return (_PROC / pid).stat().st_uid == os.getuid()


def is_alive(pid: int) -> bool:
    """True while ``pid`` exists and is not a zombie."""
    info = _parent_and_state(pid)
    if info is None:
        return _PROC.is_dir() is False and _signal_probe(pid)
    return info[1] != "Z"


def _signal_probe(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, PermissionError):
        return False
    return True


def signal_all(pids: Iterable[int], pgids: Iterable[int], sig: int) -> None:
    """Send ``sig`` to each process group and each pid, ignoring those already gone."""
    for pgid in pgids:
        try:
            os.killpg(pgid, sig)
        except (ProcessLookupError, PermissionError):
            pass
    for pid in pids:
        try:
            os.kill(pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


def _job_processes(roots: list[int], marker: tuple[str, str] | None) -> list[int]:
    found = roots + [d for r in roots for d in descendants(r)]
    if marker is not None:
        marked = processes_with_env(*marker) + processes_named(process_name(marker[1]))
        found += [p for p in dict.fromkeys(marked) if p not in found]
    return found


def terminate_tree(root_pids: Iterable[int], grace_s: float, marker: tuple[str, str] | None = None) -> None:
    """Stop processes, their process groups and all their descendants: SIGTERM, grace, then SIGKILL.

    Each root is assumed to lead its own process group (started with ``start_new_session``).

    Args:
        root_pids: the processes the launcher started.
        grace_s: seconds to wait after SIGTERM before SIGKILL.
        marker: ``(name, value)`` of an environment variable that marks the job's processes; every
            process carrying it is stopped too (orphaned daemons included), and every process named
            :func:`~phalanx.env.contract.process_name` of the value (what a warm-started rank forks).
    """
    roots = list(root_pids)
    everyone = _job_processes(roots, marker)
    signal_all(everyone, roots, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and any(is_alive(p) for p in everyone):
        time.sleep(0.02)
    # Late children (forked during the grace period) are found again before the final blow.
    everyone = _job_processes(roots, marker) + everyone
    signal_all([p for p in dict.fromkeys(everyone) if is_alive(p)], roots, signal.SIGKILL)
