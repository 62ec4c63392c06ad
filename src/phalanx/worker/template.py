"""``python -m phalanx.worker.template FD MODULE...``: a warm template that forks ranks on request.

The template imports heavy modules (torch, numpy, the user's third-party packages) once and then forks a
fresh child per rank, so a job's ranks skip interpreter start-up and imports. It never runs user code and
never touches CUDA, so every child starts from the same clean state; each child gets the job's own
environment, working directory and output pipes.

It talks to its launcher over the inherited ``SOCK_SEQPACKET`` socket ``FD`` (one JSON message per
packet, pipe descriptors passed with ``SCM_RIGHTS``):

- launcher -> template: ``{"spawn": id, "env": {...}, "cwd": "...", "python": {...} | null}`` with two
  descriptors (stdout, stderr); ``python`` describes a command job's ``python SCRIPT`` / ``python -m
  MODULE`` (:mod:`phalanx.worker.pyrun`); without it the function worker runs.
- template -> launcher: ``{"ready": true}``, ``{"spawned": id, "pid": N}``, ``{"exited": N, "returncode": C}``.

The template is single-threaded by design (fork copies only the calling thread). It exits when the
launcher closes the socket, and its children die with it (parent-death signal).
"""

from __future__ import annotations

import atexit
import importlib
import json
import os
import select
import signal
import socket
import sys
from collections.abc import Callable, Sequence
from typing import Any

from phalanx.env import names as env_names
from phalanx.env import settings
from phalanx.env.contract import process_name
from phalanx.worker.lifeline import die_with_parent, set_process_name

#: What every template imports before the job's own modules: torch, the worker entry, and the
#: ``phalanx_shm`` backend, which a one-host job's ``init_process_group("gloo")`` becomes (docs/shm.md).
ALWAYS = ("torch", "torch.distributed", "phalanx.worker.runtime", "phalanx.worker.pyrun", "phalanx.transport.backend")

MAX_MESSAGE_BYTES = 1 << 20
REAP_INTERVAL_S = 0.005
#: The environment the template started with (what its interpreter and imports read at start-up).
STARTUP_ENV = dict(os.environ)


def send(sock: socket.socket, message: dict[str, Any], fds: list[int] | None = None) -> None:
    """Send one JSON message, with descriptors when given."""
    data = json.dumps(message).encode()
    if fds:
        socket.send_fds(sock, [data], fds)
    else:
        sock.send(data)


def preload(modules: list[str]) -> None:
    """Import ``ALWAYS`` and then ``modules``; a module that fails here is imported (and fails) in the rank."""
    _import([*ALWAYS, *(name for name in modules if name not in ALWAYS)])


def _import(modules: list[str]) -> None:
    for name in modules:
        try:
            importlib.import_module(name)
        except Exception:  # a module that fails here is imported (and fails) in the rank
            continue


def _become_rank(message: dict[str, Any], out_fd: int, err_fd: int) -> int:
    """In the forked child: take the job's identity, then run the worker entry."""
    os.setsid()
    for target, fd in ((1, out_fd), (2, err_fd)):
        os.dup2(fd, target)
        os.close(fd)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    os.chdir(message["cwd"])
    os.environ.clear()
    os.environ.update(message["env"])
    # /proc/<pid>/environ still shows the template's environment: the name marks the job's processes.
    set_process_name(process_name(settings.RUN_ID.get()))
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    sys.argv = ["-m phalanx.worker"]
    _reseed()
    _apply_thread_count()
    if message.get("python") is not None:
        from phalanx.worker import pyrun

        return pyrun.run(message["python"], STARTUP_ENV)
    from phalanx.worker.runtime import main

    return main()


def _reseed() -> None:
    """Give the rank generators of its own, as a fresh interpreter has: torch's and numpy's global generators
    are seeded once per process (from the OS) and a fork copies their state, so without this every rank
    forked from one template would draw the same numbers. (Python's ``random`` reseeds itself at fork; a
    seeded program reseeds them all anyway.)"""
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.seed()  # CPU now; CUDA's seed only queued: no CUDA context is made here
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        numpy.random.seed()


def _apply_thread_count() -> None:
    """Give the rank the thread count its environment asks for.

    OpenMP reads ``OMP_NUM_THREADS`` once, when torch is loaded - in the template, before the job's
    environment existed - so a forked rank would keep one thread per core and N ranks would
    oversubscribe the host (each rank's OpenMP team as large as the whole host).
    """
    torch = sys.modules.get("torch")
    raw = os.environ.get(env_names.OMP_NUM_THREADS, "")
    if torch is not None and raw.isdigit() and int(raw) > 0:
        torch.set_num_threads(int(raw))


def fork_rank(message: dict[str, Any], fds: list[int], close: Sequence[socket.socket | int]) -> int:
    """Fork one rank from ``message`` with its two output descriptors; returns its pid. The child closes
    ``close`` (the template's own sockets) first and never returns."""
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            for held in close:
                if isinstance(held, socket.socket):
                    held.close()
                else:
                    os.close(held)
            code = _become_rank(message, fds[0], fds[1])
        except BaseException:  # report anything, then leave without unwinding the template
            import traceback

            traceback.print_exc()
        finally:
            # A cold-started rank is an interpreter that exits normally: its atexit hooks (the user's, a
            # timeline's stop, TensorFlow's temporary files) run. os._exit alone would skip them.
            atexit._run_exitfuncs()
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    for fd in fds:
        os.close(fd)
    return pid


def _fork(sock: socket.socket, message: dict[str, Any], fds: list[int]) -> None:
    send(sock, {"spawned": message["spawn"], "pid": fork_rank(message, fds, [sock])})


def reap(report: Callable[[int, int], None]) -> int:
    """Report every child that ended (its pid and return code); returns 1 while some child still runs, else 0."""
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return 0
        if pid == 0:
            return 1
        report(pid, os.waitstatus_to_exitcode(status))


def _reap(sock: socket.socket) -> int:
    return reap(lambda pid, code: send(sock, {"exited": pid, "returncode": code}))


def serve(sock: socket.socket) -> None:
    """Answer spawn requests until the launcher closes the socket."""
    children = 0
    while True:
        readable, _, _ = select.select([sock], [], [], REAP_INTERVAL_S if children else None)
        if readable:
            data, fds, _, _ = socket.recv_fds(sock, MAX_MESSAGE_BYTES, 2)
            if not data:
                return
            _fork(sock, json.loads(data), fds)
            children += 1
        children = _reap(sock)


def main(argv: list[str]) -> int:
    """Entry point: ``FD MODULE...``."""
    die_with_parent()
    sock = socket.socket(fileno=int(argv[0]))
    preload(argv[1:])
    send(sock, {"ready": True})
    try:
        serve(sock)
    except (BrokenPipeError, ConnectionResetError):
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
