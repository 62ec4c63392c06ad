"""A warm-start template shared by the processes of one owner: on Spark, one per executor for its python workers.

The template (:mod:`phalanx.worker.template_shared`) imports torch once for the owner's life and forks the
ranks that any of its python workers (one per running task) asks for, so a job of one-rank tasks pays no
import either after the executor's first. It is found by name: an abstract Unix socket named after this
user, the owner's pid and start time, and the interpreter, so tasks of one executor meet and nobody else's
do. The first task binds the name (atomically: a second binder fails) and starts the template on that socket;
later tasks connect.

Trust: both ends check that the other is this user (``SO_PEERCRED``); the abstract name lives in the network
namespace, so another user could take it first, which then only makes this executor's ranks start as
:mod:`phalanx.launch.warm` does without it. Requests are JSON the template validates (no command, no pickle).

Lifetimes: the template lives as long as the owner (not as the python worker that started it, which Spark
may stop when idle); each rank as long as the connection of the task that asked for it (the template kills
a rank whose task's connection closes, so a killed task's rank dies); the ranks die with the template.
"""

from __future__ import annotations

import errno
import hashlib
import logging
import os
import socket
import subprocess
import sys
import time

from phalanx.env import names as env_names
from phalanx.job.local_peer import peer_credentials, start_time
from phalanx.launch.warm import TemplateLink

log = logging.getLogger(__name__)

#: Seconds to retry connecting to a name another task bound but has not started listening on yet.
CONNECT_WAIT_S = 2.0
_CONNECT_STEP_S = 0.01
_BACKLOG = 64

# The templates this process started: held so that the handles are not collected (and reaped when done).
_started: list[subprocess.Popen[bytes]] = []


def socket_name(owner: int, started: int) -> str:
    """The abstract socket name of the template of ``owner`` (pid, started at ``started``) for this user and
    interpreter."""
    digest = hashlib.sha256(sys.executable.encode()).hexdigest()[:12]
    return f"\0phalanx-template-{os.getuid()}-{owner}-{started}-{digest}"


def _connect(name: str) -> TemplateLink | None:
    """A link to the template listening on ``name``, or None when none does (or it is not this user's)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        sock.connect(name)
    except OSError:
        sock.close()
        return None
    # The credentials of whoever bound the name (a task of this user, or a squatter); the template's own pid
    # comes with its "ready".
    pid, uid = peer_credentials(sock)
    if uid != os.getuid():
        sock.close()
        log.warning("a process of uid %d holds this executor's template name; starting ranks without it", uid)
        return None
    return TemplateLink(sock, pid)


def _start(name: str, owner: int, started: int, preload: tuple[str, ...]) -> bool:
    """Bind ``name`` and start the template on it; False when another process holds the name."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        listener.bind(name)
        listener.listen(_BACKLOG)
    except OSError as e:
        listener.close()
        if e.errno != errno.EADDRINUSE:
            raise
        return False
    try:
        env = {k: v for k, v in os.environ.items() if k != env_names.PHALANX_PARENT_PID}
        env[env_names.PYTHONUNBUFFERED] = "1"
        # Its own session, no parent-death signal: it outlives the python worker that starts it.
        _started.append(subprocess.Popen(
            [sys.executable, "-m", "phalanx.worker.template_shared", str(listener.fileno()), str(owner), str(started),
             *preload],
            pass_fds=(listener.fileno(),), start_new_session=True, env=env,
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        ))
    finally:
        listener.close()
    return True


def link(preload: tuple[str, ...], owner: int | None = None) -> TemplateLink | None:
    """A connection to the shared template of ``owner`` (default: this process's parent, the executor's
    python daemon or JVM), started now with ``preload`` when none runs; None when none can be had (the caller
    then starts its ranks as before). Does not wait for the template's imports (``TemplateLink.wait_ready``)."""
    owner = os.getppid() if owner is None else owner
    started = start_time(owner)
    if started is None:
        return None
    name = socket_name(owner, started)
    deadline = time.monotonic() + CONNECT_WAIT_S
    try:
        found = _connect(name)
        if found is None and _start(name, owner, started, preload):
            found = _connect(name)
        while found is None and time.monotonic() < deadline:
            time.sleep(_CONNECT_STEP_S)  # the name's binder is between bind() and listen()
            found = _connect(name)
    except OSError as e:
        log.debug("no shared warm-start template: %s", e)
        return None
    return found
