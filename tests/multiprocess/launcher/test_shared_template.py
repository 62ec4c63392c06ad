"""The template shared by one owner's processes (a Spark executor's python workers): found again by later tasks,
a rank dies with the task that asked for it, the template ends with its owner, and nothing is left behind."""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from typing import Any

import pytest

from phalanx.env import JobContract, assign_ranks, compose_env, worker_env
from phalanx.job.local_peer import start_time
from phalanx.launch.proctree import cmdline, is_alive, parent_of
from phalanx.launch.shared_template import socket_name

pytestmark = [pytest.mark.multiprocess]

# A task: link to the owner's template, fork one rank from it, say who is who, then wait for its stdin to close.
_TASK = textwrap.dedent("""
    import json, os, sys
    from phalanx.launch import shared_template
    link = shared_template.link((), owner=int(sys.argv[1]))
    assert link is not None and link.wait_ready(120), "no shared template"
    rank = link.spawn(json.loads(os.environ["RANK_ENV"]), os.getcwd())
    print(json.dumps({"template": link.pid, "rank": rank.pid}), flush=True)
    sys.stdin.read()
""")
WAIT_S = 60.0
NOBODY = 65534


def _ends(pid: int, timeout_s: float = WAIT_S) -> bool:
    """Wait for any process (not only a child) to end; True when it did within ``timeout_s``."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return True
    try:
        return bool(select.select([fd], [], [], timeout_s)[0])
    finally:
        os.close(fd)


def _as_stranger(name: str) -> bytes:
    """What a process of another user receives first from the socket ``name`` (b'': it was closed)."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # only system calls here: the test process has threads
        try:
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            sock.connect(name)
            sock.settimeout(WAIT_S)
            os.write(w, b"got:" + sock.recv(4096))
        finally:
            os._exit(0)
    os.close(w)
    with os.fdopen(r, "rb") as got:
        answer = got.read()
    os.waitpid(pid, 0)
    assert answer.startswith(b"got:"), "the stranger could not connect"
    return answer[4:]


@pytest.fixture
def silent_channel() -> Iterator[str]:
    """A channel address that accepts connections and never answers: a rank waits there until killed."""
    server = socket.create_server(("127.0.0.1", 0))
    yield f"127.0.0.1:{server.getsockname()[1]}"
    server.close()


def _task(owner: int, rank_env: dict[str, str]) -> tuple[subprocess.Popen[str], dict[str, Any]]:
    proc = subprocess.Popen([sys.executable, "-c", _TASK, str(owner)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, env={**os.environ, "RANK_ENV": json.dumps(rank_env)})
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert line, f"the task ended with {proc.wait()}"
    return proc, json.loads(line)


def _shm() -> set[str]:
    return set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()


@pytest.mark.timeout(240)
def test_tasks_share_the_owners_template_and_their_ranks_die_with_them(silent_channel: str) -> None:
    shm = _shm()
    job = JobContract(run_id="shared-template-test", master_addr="127.0.0.1", master_port=1,
                      channel=silent_channel, secret="ab" * 16, start_timeout_s=WAIT_S * 3)
    rank_env = compose_env(os.environ, {}, worker_env(job, assign_ranks(["here"])[0]))
    executor = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    assert executor.stdin is not None
    first, a = _task(executor.pid, rank_env)
    second, b = _task(executor.pid, rank_env)
    try:
        # One template for both tasks (a template per task would have two pids), the parent of both ranks.
        assert a["template"] == b["template"]
        assert "phalanx.worker.template_shared" in cmdline(a["template"])
        assert parent_of(a["rank"]) == parent_of(b["rank"]) == a["template"]
        assert a["rank"] != b["rank"]
        if os.getuid() == 0:  # another user's process is refused before it is read
            assert _as_stranger(socket_name(executor.pid, start_time(executor.pid) or 0)) == b""

        first.kill()  # a killed task's rank dies; the template and the other task's rank live on
        first.wait()
        assert _ends(a["rank"]), f"rank {a['rank']} outlived its killed task"
        assert is_alive(b["rank"]) and is_alive(b["template"])

        executor.stdin.close()  # the owner ends: the template ends, and with it every rank it forked
        executor.wait(WAIT_S)
        assert _ends(b["template"]), "the template outlived its owner"
        assert _ends(b["rank"]), "a rank outlived its template"
    finally:
        for proc in (first, second, executor):
            if proc.poll() is None:
                proc.send_signal(signal.SIGKILL)
            proc.wait()
    assert _shm() == shm
