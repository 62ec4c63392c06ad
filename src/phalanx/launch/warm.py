"""Warm starts: a pre-imported template process that forks the ranks of later function jobs.

A template process (:mod:`phalanx.worker.template`) imports torch and a function job's third-party packages
once; jobs ask it to fork their ranks: each rank is still a new process with the job's own environment,
but interpreter start-up and imports are paid once per driver, not once per rank. The first function job
of a driver starts the template and forks its ranks from it too (:func:`template_for_job`), so N ranks
cost one import, not N (on a host with fewer cores than ranks, N imports run one after the other). Set
``PHALANX_WARM_START=0`` to turn this off (every rank then starts a fresh interpreter). The template
dies with the driver (``atexit``, parent-death signal, socket EOF).

The template is always started from one thread that lives as long as the driver: Linux sends the
parent-death signal when the *thread* that forked a child exits, not the process, so a template started
by a job run in a short-lived thread was SIGKILLed with that thread (and the next job's ranks with it).
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import queue
import socket
import subprocess
import sys
import threading
import types
from collections.abc import Callable
from typing import IO, Any, Protocol

from phalanx.env import names as env_names
from phalanx.env import settings
from phalanx.job.framing import close_socket
from phalanx.launch.proctree import terminate_tree

log = logging.getLogger(__name__)

_MAX_MESSAGE_BYTES = 1 << 20
#: Seconds a job waits for a template that is still importing before it starts cold instead.
READY_WAIT_S = 3.0
#: Seconds the template has to answer a spawn request.
SPAWN_TIMEOUT_S = 10.0


class RankProcess(Protocol):
    """What the launcher needs of a rank's process (``subprocess.Popen`` has it)."""

    pid: int
    stdout: IO[bytes] | None
    stderr: IO[bytes] | None

    def poll(self) -> int | None:
        """The return code, or None while running."""

    def wait(self, timeout: float | None = None) -> int:
        """Wait for the return code (raises ``subprocess.TimeoutExpired``)."""


class ForkedRank:
    """A rank forked by the template; the template reaps it and reports its return code."""

    def __init__(self, pid: int, stdout: IO[bytes], stderr: IO[bytes]) -> None:
        self.pid = pid
        self.stdout: IO[bytes] | None = stdout
        self.stderr: IO[bytes] | None = stderr
        self.returncode: int | None = None
        self._done = threading.Event()

    def set_exit(self, returncode: int) -> None:
        """Record the return code (called by the template reader)."""
        if self.returncode is None:
            self.returncode = returncode
        self._done.set()

    def poll(self) -> int | None:
        """The return code, or None while running."""
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        """Wait for the return code."""
        if not self._done.wait(timeout):
            raise subprocess.TimeoutExpired(f"rank pid {self.pid}", timeout or 0.0)
        assert self.returncode is not None
        return self.returncode


class TemplateLink:
    """One connection to a template process: spawn requests out; its readiness, forks and ranks' exits in.

    Args:
        sock: the connected ``SOCK_SEQPACKET`` socket.
        pid: the template's pid (the forked ranks' parent).
    """

    def __init__(self, sock: socket.socket, pid: int) -> None:
        self.pid = pid
        self._sock = sock
        self._lock = threading.Lock()
        self._ready = threading.Event()
        self._next_id = 0
        self._pending: dict[int, tuple[IO[bytes], IO[bytes], threading.Event, list[ForkedRank]]] = {}
        self._ranks: dict[int, ForkedRank] = {}
        self.alive = True
        threading.Thread(target=self._read_loop, name="phalanx-template", daemon=True).start()

    def wait_ready(self, timeout_s: float) -> bool:
        """True once the template finished its imports (False if it died)."""
        return self._ready.wait(timeout_s) and self.alive

    def spawn(self, env: dict[str, str], cwd: str, python: dict[str, Any] | None = None) -> ForkedRank:
        """Fork one rank with this environment and working directory: the function worker, or a command
        job's ``python SCRIPT`` / ``python -m MODULE`` (``python``: ``core.python_command``'s description).

        Raises:
            OSError: the template is gone or did not answer within SPAWN_TIMEOUT_S.
        """
        r_out, w_out = os.pipe()
        r_err, w_err = os.pipe()
        done = threading.Event()
        box: list[ForkedRank] = []
        with self._lock:
            ident = self._next_id
            self._next_id += 1
            self._pending[ident] = (os.fdopen(r_out, "rb"), os.fdopen(r_err, "rb"), done, box)
        try:
            message = json.dumps({"spawn": ident, "env": {**env, env_names.PHALANX_PARENT_PID: str(self.pid)},
                                  "cwd": cwd, "python": python}).encode()
            socket.send_fds(self._sock, [message], [w_out, w_err])
        finally:
            os.close(w_out)
            os.close(w_err)
        if not done.wait(SPAWN_TIMEOUT_S) or not box:
            raise OSError(f"the warm-start template did not fork a rank within {SPAWN_TIMEOUT_S:g} s")
        return box[0]

    def _read_loop(self) -> None:
        try:
            while True:
                data = self._sock.recv(_MAX_MESSAGE_BYTES)
                if not data:
                    break
                self._dispatch(json.loads(data))
        except OSError:
            pass
        self._gone()

    def _dispatch(self, message: dict[str, Any]) -> None:
        if message.get("ready"):
            if isinstance(message.get("pid"), int):
                self.pid = message["pid"]  # a shared template's own (its socket's credentials are its starter's)
            self._ready.set()
        elif "spawned" in message:
            with self._lock:
                out, err, done, box = self._pending.pop(message["spawned"])
                rank = ForkedRank(int(message["pid"]), out, err)
                self._ranks[rank.pid] = rank
            box.append(rank)
            done.set()
        elif "exited" in message:
            with self._lock:
                rank = self._ranks.pop(int(message["exited"]))
            rank.set_exit(int(message["returncode"]))
        elif "refused" in message:
            log.warning("the warm-start template refused a spawn request: %s", message["refused"])
            with self._lock:
                pending, self._pending = list(self._pending.values()), {}
            for _, _, done, _ in pending:
                done.set()

    def _gone(self) -> None:
        """The template ended: its children died with it (parent-death signal)."""
        self.alive = False
        self._ready.set()
        with self._lock:
            ranks, self._ranks = list(self._ranks.values()), {}
            pending, self._pending = list(self._pending.values()), {}
        for rank in ranks:
            rank.set_exit(-9)
        for _, _, done, _ in pending:
            done.set()

    def pids(self) -> set[int]:
        """The template's pid while it runs."""
        return {self.pid} if self.alive else set()

    def close(self) -> None:
        """Close this connection (a shared template then kills the ranks it forked for it)."""
        close_socket(self._sock)


class Template(TemplateLink):
    """The driver's own template process, started here and stopped with the driver."""

    def __init__(self, preload: tuple[str, ...], base_env: dict[str, str] | None = None) -> None:
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        env = {**(os.environ if base_env is None else base_env), env_names.PHALANX_PARENT_PID: str(os.getpid()),
               env_names.PYTHONUNBUFFERED: "1"}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "phalanx.worker.template", str(theirs.fileno()), *preload],
            pass_fds=(theirs.fileno(),), start_new_session=True, env=env,
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        theirs.close()
        self.preload = preload
        super().__init__(mine, self.proc.pid)

    def close(self) -> None:
        """Stop the template and every rank it forked."""
        super().close()
        terminate_tree([self.proc.pid], grace_s=1.0)
        self.proc.wait(timeout=10)


def enabled() -> bool:
    """Warm starts are on unless ``PHALANX_WARM_START=0``, and need Linux (fork + SCM_RIGHTS)."""
    return (settings.WARM_START.get() and sys.platform.startswith("linux")
            and hasattr(socket, "send_fds"))


def _third_party(module: types.ModuleType) -> str | None:
    path = getattr(module, "__file__", None) or ""
    top = module.__name__.split(".")[0]
    return top if ("site-packages" in path or "dist-packages" in path) and top != "phalanx" else None


def preload_for(fn: Callable[..., Any]) -> tuple[str, ...]:
    """Modules worth importing in the template besides its own (``worker.template.ALWAYS``): numpy if loaded,
    and the packages of the modules the function references (third-party, and phalanx's own)."""
    names = ["numpy"] if "numpy" in sys.modules else []
    code = getattr(fn, "__code__", None)
    scope = getattr(fn, "__globals__", {})
    for name in code.co_names if code is not None else ():
        value = scope.get(name)
        module = value if isinstance(value, types.ModuleType) else sys.modules.get(getattr(value, "__module__", ""))
        top = _third_party(module) or _phalanx_package(module) if isinstance(module, types.ModuleType) else None
        if top and top not in names:
            names.append(top)
    return tuple(names)


def _phalanx_package(module: types.ModuleType) -> str | None:
    """``phalanx.x`` for a module of phalanx's package ``x``: phalanx's own code, unlike the user's, does not
    change between jobs (and may live outside site-packages in an editable install)."""
    parts = module.__name__.split(".")
    return ".".join(parts[:2]) if parts[0] == "phalanx" and len(parts) > 1 else None


class _Starter:
    """Runs calls in one daemon thread that lives as long as the process (see the module docstring)."""

    def __init__(self) -> None:
        self._calls: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def run(self, fn: Callable[[], Template]) -> Template:
        """``fn()``, called in the long-lived thread; its exception is raised here."""
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="phalanx-warm-starter", daemon=True)
                self._thread.start()
        box: list[Template | BaseException] = []
        done = threading.Event()

        def call() -> None:
            try:
                box.append(fn())
            except BaseException as e:
                box.append(e)
            done.set()

        self._calls.put(call)
        done.wait()
        if isinstance(box[0], BaseException):
            raise box[0]
        return box[0]

    def _loop(self) -> None:
        while True:
            self._calls.get()()


_pool_lock = threading.Lock()
_template: Template | None = None
_starter = _Starter()


def ready_template(timeout_s: float = READY_WAIT_S) -> Template | None:
    """The running template once its imports are done, or None (then start cold)."""
    template = _template
    if template is None or not template.alive:
        return None
    return template if template.wait_ready(timeout_s) else None


def job_wait_s(start_timeout_s: float) -> float:
    """How long a job waits for the template it started: its imports are the ones each cold rank would make,
    so starting cold instead only pays them again; the job's start timeout bounds the wait (a second is
    left for the forks and the ranks' connections)."""
    return max(READY_WAIT_S, start_timeout_s - 1.0)


def template_for_job(preload: tuple[str, ...], wait_s: float,
                     base_env: dict[str, str] | None = None) -> Template | None:
    """The template a job forks its ranks from: the running one, else one started now (in ``base_env``,
    default this process's environment) and waited for up to ``wait_s`` (its imports are the ones every
    cold rank would make); None when warm starts are off, or when it is not ready in time or failed (the
    job then starts cold)."""
    if not enabled():
        return None
    template = ready_template()
    if template is not None:
        return template
    prepare(preload, base_env)
    return ready_template(wait_s)


def prepare(preload: tuple[str, ...], base_env: dict[str, str] | None = None) -> None:
    """Start a template in the background if none runs (called after a job, or by its first one)."""
    global _template
    if not enabled():
        return
    with _pool_lock:
        if _template is not None and _template.alive:
            return
        try:
            _template = _starter.run(lambda: Template(preload, base_env))
        except OSError as e:
            log.debug("could not start the warm-start template: %s", e)


def template_pids() -> set[int]:
    """Pids of the running template (tests use it to tell the template from leftovers)."""
    template = _template
    return template.pids() if template is not None else set()


def shutdown() -> None:
    """Stop the template; the next job starts cold."""
    global _template
    with _pool_lock:
        template, _template = _template, None
    if template is not None:
        template.close()


atexit.register(shutdown)
