"""Spark fixtures: a SparkContext shared by the modules that use the same kind (a JVM starts slowly), and a
real standalone cluster.

A pytest process holds one SparkContext at a time. ``local_spark`` keeps its ``local[2]`` session for the
next module that wants one; a module wanting another kind (the standalone cluster, a Connect server) stops
it first, and the session's end stops whatever is left. The standalone cluster is a master and two workers
started from pyspark's bundled ``spark-class`` on loopback addresses 127.0.0.1 and 127.0.0.2 (two "hosts",
so local and cross ranks mean something), each with 2 cores and 2 fake GPUs from a discovery script; it
lives for the whole test session, its modules run one after the other (``pytest_collection_modifyitems``),
and each of them gets a session of its own (fresh executors).

PySpark's python worker daemons are long-lived children of the JVM that Spark reuses between jobs; the
leftover-process check ignores them (and only them): every phalanx process must still be gone.
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from phalanx.launch.proctree import cmdline, parent_of, terminate_tree

pytestmark = [pytest.mark.spark]

SPARK_START_TIMEOUT_S = 120.0
# PySpark's daemons, and an executor JVM a standalone worker started again after one was killed on purpose
_SPARK_OWNED = ("pyspark.daemon", "pyspark/daemon.py", "org.apache.spark.executor.CoarseGrainedExecutorBackend")


def _spark_owned(pid: int) -> bool:
    """PySpark's daemons and their worker forks; and a warm-start template that one of them started
    (it lives as long as its executor, by design). The ranks a template forks are counted."""
    cmd = cmdline(pid)
    if any(s in cmd for s in _SPARK_OWNED):
        return True
    parent = parent_of(pid)
    return "phalanx.worker.template" in cmd and parent is not None and any(
        s in cmdline(parent) for s in _SPARK_OWNED)


@pytest.fixture
def process_is_expected() -> Callable[[int], bool]:
    """PySpark's reusable python daemons (and their forks) are not leftovers."""
    return _spark_owned


def _warm_up(spark: Any, tasks: int) -> None:
    # Starts the python daemons before any test's process snapshot.
    spark.sparkContext.parallelize(range(tasks), tasks).barrier().mapPartitions(lambda it: [sys.executable]).collect()


def _session(master: str, conf: dict[str, str]) -> Any:
    from pyspark.sql import SparkSession

    builder = SparkSession.builder.master(master).appName("phalanx-tests")
    base = {"spark.ui.enabled": "false", "spark.ui.showConsoleProgress": "false",
            "spark.driver.host": "127.0.0.1", "spark.driver.bindAddress": "127.0.0.1",
            "spark.pyspark.python": sys.executable, "spark.executorEnv.PYSPARK_PYTHON": sys.executable}
    for key, value in {**base, **conf}.items():
        builder = builder.config(key, value)
    spark = builder.getOrCreate()
    spark.sparkContext.setLogLevel("ERROR")
    spark.sparkContext.pythonExec = sys.executable
    return spark


def stop_spark(spark: Any) -> None:
    """Stop the session *and* the py4j JVM (pyspark keeps it for the process's life otherwise)."""
    from pyspark import SparkContext

    spark.stop()
    gateway = SparkContext._gateway
    if gateway is None:
        return
    proc = getattr(gateway, "proc", None)
    gateway.shutdown()
    SparkContext._gateway = None
    SparkContext._jvm = None
    if proc is not None:
        proc.stdin.close()  # the JVM exits when its stdin closes
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            terminate_tree([proc.pid], 5.0)
            proc.wait(timeout=10)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Move this directory's tests that use the standalone cluster after its other tests, keeping their
    order: one cluster (and one session on it) serves them all."""
    here = Path(__file__).parent
    slots = [i for i, item in enumerate(items) if item.path.parent == here]
    ours = sorted((items[i] for i in slots),
                  key=lambda item: any(name.startswith("standalone_spark") for name in item.fixturenames))
    for i, item in zip(slots, ours):
        items[i] = item


def stop_active_spark() -> None:
    """Stop the classic SparkContext that is running, if any (and its JVM)."""
    from pyspark import SparkContext
    from pyspark.sql import SparkSession

    sc = SparkContext._active_spark_context
    if sc is None:
        return
    try:
        stop_spark(SparkSession(sc))
    except Exception:  # a broken gateway: its JVM must still go
        proc = getattr(SparkContext._gateway, "proc", None)
        if proc is not None:
            terminate_tree([proc.pid], 5.0)
        SparkContext._active_spark_context = SparkContext._gateway = SparkContext._jvm = None


def _active_master() -> str | None:
    """The master of the running SparkContext; None when there is none, or when it no longer answers (a test
    that timed out in the middle of a py4j call leaves it so): then it is stopped, for a fresh one."""
    from pyspark import SparkContext

    sc = SparkContext._active_spark_context
    if sc is None:
        return None
    try:
        if not sc._jsc.sc().isStopped():
            return str(sc.master)
    except Exception:  # py4j's errors: the gateway is broken
        pass
    stop_active_spark()
    return None


@pytest.fixture(scope="session")
def spark_at_session_end() -> Iterator[None]:
    """Stops the SparkContext the modules left running when the test session ends."""
    yield
    stop_active_spark()


def shared_local_spark() -> Any:
    """The ``local[2]`` test session: the running one when there is one, else a new one (after stopping a
    SparkContext of another kind)."""
    from pyspark.sql import SparkSession

    if _active_master() == "local[2]":
        return SparkSession.builder.getOrCreate()
    stop_active_spark()
    spark = _session("local[2]", {})
    _warm_up(spark, 2)
    return spark


@pytest.fixture(scope="module")
def local_spark(spark_at_session_end: None) -> Iterator[Any]:
    """A ``local[2]`` SparkSession, shared with the next modules that use this fixture."""
    yield shared_local_spark()


# Addresses that are not 0..n-1, so a rank pinned to "its GPU" must take the one Spark assigned its task.
GPU_ADDRESSES = ("3", "5")
GPU_SCRIPT = """#!/bin/sh
echo '{"name": "gpu", "addresses": ["3", "5"]}'
"""


def _wait_for_log(path: Path, pattern: str, count: int, proc: subprocess.Popen[bytes]) -> list[str]:
    deadline = time.monotonic() + SPARK_START_TIMEOUT_S
    while time.monotonic() < deadline:
        found = re.findall(pattern, path.read_text(errors="replace")) if path.exists() else []
        if len(found) >= count:
            return found
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args} exited with {proc.returncode}; log:\n{path.read_text()[-3000:]}")
        time.sleep(0.2)
    raise TimeoutError(f"{pattern!r} not seen {count} time(s) in {path} within {SPARK_START_TIMEOUT_S} s")


def _spark_class() -> Path:
    import pyspark

    return Path(pyspark.__file__).parent / "bin" / "spark-class"


def _start(argv: list[str], log: Path, env: dict[str, str]) -> subprocess.Popen[bytes]:
    with open(log, "wb") as out:
        return subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env=env, start_new_session=True)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Cluster:
    """A running standalone cluster: its master URL and the processes to stop."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.procs: list[subprocess.Popen[bytes]] = []
        self.url = ""
        self.gpu_script = tmp / "gpus.sh"
        self.gpu_script.write_text(GPU_SCRIPT)
        self.gpu_script.chmod(0o755)

    def env(self, host: str = "127.0.0.1") -> dict[str, str]:
        import pyspark

        env = dict(os.environ, SPARK_HOME=str(Path(pyspark.__file__).parent), PYSPARK_PYTHON=sys.executable,
                   SPARK_NO_DAEMONIZE="1", SPARK_LOCAL_IP=host)
        env["SPARK_WORKER_OPTS"] = (f"-Dspark.worker.resource.gpu.amount=2 "
                                    f"-Dspark.worker.resource.gpu.discoveryScript={self.gpu_script}")
        return env

    def start(self) -> None:
        master_log = self.tmp / "master.log"
        port = _free_port()  # workers start at once and retry until the master listens
        self.url = f"spark://127.0.0.1:{port}"
        self.procs.append(_start([str(_spark_class()), "org.apache.spark.deploy.master.Master", "--host",
                                  "127.0.0.1", "--port", str(port), "--webui-port", "0"], master_log, self.env()))
        for i, host in enumerate(("127.0.0.1", "127.0.0.2")):
            work = self.tmp / f"worker{i}"
            work.mkdir()
            self.procs.append(_start([str(_spark_class()), "org.apache.spark.deploy.worker.Worker", "--host", host,
                                      "--cores", "2", "--memory", "2g", "--webui-port", "0", "--work-dir",
                                      str(work), self.url], self.tmp / f"worker{i}.log", self.env(host)))
        _wait_for_log(master_log, r"Registering worker", 2, self.procs[0])

    def stop(self) -> None:
        terminate_tree([p.pid for p in self.procs], 10.0)
        for p in self.procs:
            p.wait(timeout=30)


@pytest.fixture(scope="session")
def standalone_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """A running standalone cluster, for the whole test session; its session is stopped before it."""
    cluster = Cluster(tmp_path_factory.mktemp("standalone"))
    try:
        cluster.start()
        yield cluster
        if _active_master() == cluster.url:
            stop_active_spark()
    finally:
        cluster.stop()


def _standalone_session(cluster: Cluster, gpus_per_task: int) -> Any:
    """A session on the standalone cluster, each task holding ``gpus_per_task`` of its executor's 2 GPUs."""
    stop_active_spark()
    spark = _session(cluster.url, {
        "spark.executor.cores": "2", "spark.executor.memory": "1g", "spark.cores.max": "4",
        "spark.executor.resource.gpu.amount": "2", "spark.task.resource.gpu.amount": str(gpus_per_task),
        "spark.executor.resource.gpu.discoveryScript": str(cluster.gpu_script),
        "spark.scheduler.minRegisteredResourcesRatio": "1.0",
        "spark.scheduler.maxRegisteredResourcesWaitingTime": "60s",
    })
    slots = 4 // gpus_per_task
    _wait_for_slots(spark, slots)
    _warm_up(spark, slots)
    return spark


@pytest.fixture(scope="module")
def standalone_spark(standalone_cluster: Cluster, spark_at_session_end: None) -> Iterator[Any]:
    """A SparkSession on the standalone cluster: 2 workers x 2 cores x 2 fake GPUs (4 task slots). Each module
    gets fresh executors (a module's killed tasks and warm-start templates stay with it); the cluster's
    master and workers are shared."""
    yield _standalone_session(standalone_cluster, 1)
    stop_active_spark()


@pytest.fixture(scope="module")
def standalone_spark_two_gpus_per_task(standalone_cluster: Cluster, spark_at_session_end: None) -> Iterator[Any]:
    """A SparkSession on the standalone cluster whose tasks hold 2 GPUs each (one task per worker)."""
    yield _standalone_session(standalone_cluster, 2)
    stop_active_spark()


def _wait_for_slots(spark: Any, slots: int) -> None:
    from phalanx.spark.session import task_slots

    deadline = time.monotonic() + SPARK_START_TIMEOUT_S
    while task_slots(spark.sparkContext) < slots:
        if time.monotonic() > deadline:
            raise TimeoutError(f"the standalone cluster did not offer {slots} slots in {SPARK_START_TIMEOUT_S} s")
        time.sleep(0.2)



_CONNECT_ENV = ("SPARK_CONNECT_MODE_ENABLED", "SPARK_LOCAL_REMOTE", "SPARK_REMOTE", "SPARK_CONNECT_AUTHENTICATE_TOKEN")


def start_connect_server(master: str) -> int:
    """Start a Spark Connect server in this process (``master``, its executors running this interpreter) on a
    free port; return the port.

    ``remote("local[2]")`` would do the same on the fixed port 15002, which concurrent test runs on one
    machine fight over (the loser's client talks to the winner's server).
    """
    from pyspark.sql.connect.session import SparkSession as RemoteSession

    port = _free_port()
    os.environ["PYSPARK_PYTHON"] = sys.executable  # the server's python workers
    RemoteSession._start_connect_server(master, {
        "spark.connect.grpc.binding.port": str(port), "spark.ui.enabled": "false",
        "spark.ui.showConsoleProgress": "false", "spark.driver.host": "127.0.0.1",
        "spark.driver.bindAddress": "127.0.0.1"})
    return port


@pytest.fixture(scope="module")
def connect_spark() -> Iterator[Any]:
    """A Spark Connect session on a ``local[2]`` Connect server, for one test module.

    The server runs in this process (its JVM and executors are ours, as for ``local_spark``). Connect mode
    is process-wide in pyspark (environment variables): they are removed again so that later modules get
    classic sessions.
    """
    from pyspark import SparkContext
    from pyspark.sql.connect.session import SparkSession as RemoteSession

    saved = os.environ.get("PYSPARK_PYTHON")
    stop_active_spark()  # the Connect server makes its own SparkContext in this process
    port = start_connect_server("local[2]")
    os.environ["SPARK_CONNECT_MODE_ENABLED"] = "1"  # what remote() sets: pyspark's is_remote()
    spark = RemoteSession.builder.remote(f"sc://localhost:{port}").getOrCreate()
    try:
        spark.range(0, 2, 1, 2).collect()  # starts the python daemons before any test's process snapshot
        yield spark
    finally:
        spark.stop()
        if SparkContext._active_spark_context is not None:
            stop_spark(SparkContext._active_spark_context)
        for key in _CONNECT_ENV:
            os.environ.pop(key, None)
        if saved is None:
            os.environ.pop("PYSPARK_PYTHON", None)
        else:
            os.environ["PYSPARK_PYTHON"] = saved
