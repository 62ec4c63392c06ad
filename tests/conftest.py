"""Fixtures shared by every tier.

``no_leftover_processes``, ``no_leftover_threads`` and ``no_leaked_environment`` are autouse: a test fails
when it leaves a child process (or zombie) of the test process behind that was not there before it
started, a thread of its own still running, or a variable phalanx reads (or one named ``PHALANX_*`` or
``HOROVOD_*``) changed in ``os.environ``; each failure names what was left.
Fixtures that must outlive a test (a Spark session, a standalone cluster) start their processes and
threads before the test's snapshot, so they are not counted; a tier whose infrastructure legitimately
starts long-lived processes overrides ``process_is_expected``. ``s3`` starts moto's S3-compatible server
for a module that asks for it.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator

import pytest

from phalanx.env import names as env_names
from phalanx.launch import warm
from phalanx.launch.proctree import cmdline, descendants, is_alive, is_zombie

LEFTOVER_WAIT_S = 10.0

# Tests send SIGINT to drivers and ranks they start and expect Python's KeyboardInterrupt there. A test run
# started in the background of a non-interactive shell (`make test &`, nohup) inherits SIGINT and SIGQUIT
# ignored, and an ignored signal stays ignored across exec, so every process the tests start would ignore
# them too. A handler of this process is reset to the default at exec: the children start as from a terminal.
for _sig in (signal.SIGINT, signal.SIGQUIT):
    if signal.getsignal(_sig) == signal.SIG_IGN:
        signal.signal(_sig, signal.default_int_handler if _sig == signal.SIGINT else signal.SIG_DFL)
#: Threads phalanx keeps for the process's life: the warm-start template's handle and starter, and
#: phalanx.torch's background runner for ``*_async`` collectives (idle between jobs).
PROCESS_LIFETIME_THREADS = frozenset({"phalanx-template", "phalanx-warm-starter", "phalanx-async"})


def live_descendants(expected: Callable[[int], bool] = lambda pid: False) -> set[int]:
    """This process's live or zombie descendants, without the warm-start template and expected ones.

    The warm-start template outlives jobs by design (it is checked at the end of the session); the ranks
    it forks are its children and are counted.
    """
    live = {p for p in descendants(os.getpid()) if (is_alive(p) or is_zombie(p)) and not expected(p)}
    return live - warm.template_pids()


def describe(pid: int) -> str:
    """``pid 12 (zombie): cmd`` for failure messages."""
    state = "zombie" if is_zombie(pid) else "alive"
    return f"pid {pid} ({state}): {cmdline(pid)[:200] or '?'}"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """A Spark test's timeout bounds the test itself, not its fixtures. The first test of a module starts a
    JVM (a session, the standalone cluster, a Connect server) and its python workers in its setup; on a loaded
    host that takes minutes, and it must not eat into the test's own time. The cluster's start has its own
    bound (SPARK_START_TIMEOUT_S); make test's runner bounds each tier as a whole (tools/test_tiers.py)."""
    default = float(config.getini("timeout") or 0)
    for item in items:
        if item.get_closest_marker("spark") is None:
            continue
        marker = item.get_closest_marker("timeout")
        seconds = marker.kwargs.get("timeout", marker.args[0] if marker.args else default) if marker else default
        item.add_marker(pytest.mark.timeout(seconds, func_only=True), append=False)


@pytest.fixture
def process_is_expected() -> Callable[[int], bool]:
    """Processes a tier's own infrastructure keeps alive between tests (none by default)."""
    return lambda pid: False


@pytest.fixture(autouse=True)
def no_leftover_processes(process_is_expected: Callable[[int], bool]) -> Iterator[None]:
    """Fail the test if it leaves child processes behind (waits up to LEFTOVER_WAIT_S for them to go)."""
    before = live_descendants(process_is_expected)
    yield
    deadline = time.monotonic() + LEFTOVER_WAIT_S
    left = live_descendants(process_is_expected) - before
    while left and time.monotonic() < deadline:
        time.sleep(0.1)
        left = live_descendants(process_is_expected) - before
    if left:
        pytest.fail("test left processes behind:\n" + "\n".join(describe(p) for p in sorted(left)))


#: Prefixes of the variables phalanx and Horovod own: a test's own ``PHALANX_TEST_*`` counts too.
OWN_PREFIXES = ("PHALANX_", "HOROVOD_")


def phalanx_variables() -> frozenset[str]:
    """Every variable phalanx reads or writes (the names in ``phalanx.env.names``), and every variable of
    the environment now under a prefix phalanx or Horovod owns."""
    named = {v for k, v in vars(env_names).items() if k.isupper() and isinstance(v, str)}
    return frozenset(named | {k for k in os.environ if k.startswith(OWN_PREFIXES)})


@pytest.fixture(autouse=True)
def no_leaked_environment() -> Iterator[None]:
    """Fail the test if it leaves a variable phalanx reads changed in this process's environment (the next
    test would run under it), and put such variables back. Other variables are third parties' business:
    TensorFlow, Lightning and pyspark set their own as they are used, once per process."""
    before = {k: os.environ.get(k) for k in phalanx_variables()}
    yield
    changed = {k: (before.get(k), os.environ.get(k)) for k in before.keys() | phalanx_variables()
               if os.environ.get(k) != before.get(k)}
    if not changed:
        return
    for k, (v, _) in changed.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
    pytest.fail("test changed the environment (use monkeypatch.setenv, or pass env= to the job):\n  "
                + "\n  ".join(f"{k}: {old!r} -> {new!r}" for k, (old, new) in sorted(changed.items())))


def _runs_phalanx_code(thread: threading.Thread) -> bool:
    target = getattr(thread, "_target", None)
    return str(getattr(target, "__module__", "")).startswith("phalanx")


def leaked_threads(before: set[threading.Thread]) -> list[threading.Thread]:
    """Threads started since ``before`` that still run: every non-daemon one, and every daemon one running
    phalanx code, but for the threads phalanx keeps for the process's life by design."""
    return [t for t in threading.enumerate()
            if t not in before and t.is_alive() and t.name not in PROCESS_LIFETIME_THREADS
            and (not t.daemon or _runs_phalanx_code(t))]


@pytest.fixture(autouse=True)
def no_leftover_threads() -> Iterator[None]:
    """Fail the test if a thread it started is still running LEFTOVER_WAIT_S after it ended."""
    before = set(threading.enumerate())
    yield
    deadline = time.monotonic() + LEFTOVER_WAIT_S
    while (left := leaked_threads(before)) and time.monotonic() < deadline:
        time.sleep(0.05)
    if left:
        pytest.fail("test left threads running:\n  " + "\n  ".join(
            f"{t.name} (daemon={t.daemon}, target={getattr(t, '_target', None)!r})" for t in left))


@pytest.fixture(scope="session", autouse=True)
def warm_template_is_shut_down() -> Iterator[None]:
    """At the end of the session, stopping the warm-start template leaves no process behind."""
    before = {p for p in descendants(os.getpid()) if is_alive(p)}
    yield
    warm.shutdown()
    deadline = time.monotonic() + LEFTOVER_WAIT_S
    while (left := {p for p in descendants(os.getpid()) if is_alive(p)} - before) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not left, "warm-start template left processes: " + ", ".join(describe(p) for p in sorted(left))


CREDENTIALS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}
SERVER_START_TIMEOUT_S = 60.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def s3(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """moto's standalone S3 server on loopback (one per module that asks), with a bucket ``ckpt``, and the
    environment that points s3fs at it (set in ``os.environ`` while the module runs)."""
    port = _free_port()
    log = tmp_path_factory.mktemp("moto") / "server.log"
    with open(log, "wb") as out:
        server = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                                  stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    env = {**CREDENTIALS, "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}"}
    deadline = time.monotonic() + SERVER_START_TIMEOUT_S
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            break
        except OSError:
            if time.monotonic() > deadline or server.poll() is not None:
                server.kill()
                raise RuntimeError(f"moto's server did not listen on port {port} within {SERVER_START_TIMEOUT_S} s: "
                                   f"{log.read_text()[-2000:]}") from None
            time.sleep(0.2)
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    import s3fs

    s3fs.S3FileSystem.clear_instance_cache()
    s3fs.S3FileSystem().mkdir("ckpt")
    yield env
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
    server.terminate()
    server.wait(10)
