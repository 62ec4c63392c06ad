"""Several GPUs per Spark task across two simulated hosts: a standalone cluster whose master and workers run
on hosta and hostb (each its own network, hostname and /dev/shm), each worker with 4 fake GPUs from a discovery
script (addresses "1","3","4","6": not 0..3), and a driver on hosta running ``TorchDistributor(num_processes=8,
use_gpu=True)`` twice: with ``spark.task.resource.gpu.amount=2`` (4 tasks of 2 ranks, two tasks on each host's
executor, so a host's local ranks come from two tasks) and with ``=4`` (2 tasks of 4 ranks, one per host). Local
and cross ranks must be right across the hosts, each rank pinned to one of the GPUs Spark assigned its host's
tasks, never shared; in the second job a rank that dies must take its task's other ranks down, the job failing
with it as the root cause. One driver runs both jobs (a JVM start less)."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from tests.hosts.simhosts import Cluster
from tests.waits import wait_until

from phalanx.launch.proctree import is_alive, terminate_tree

pytestmark = [pytest.mark.multiprocess, pytest.mark.hosts, pytest.mark.timeout(400)]

GPUS = ("1", "3", "4", "6")
START_TIMEOUT_S = 180.0
DRIVER = r'''import json, os, signal, sys, time
from pathlib import Path
from pyspark.sql import SparkSession
from phalanx.errors import WorkerFailedError
from phalanx.spark import TorchDistributor
from phalanx.spark.session import task_slots

master, script, out = sys.argv[1], sys.argv[2], Path(sys.argv[3])
os.environ["HOROVOD_START_TIMEOUT"] = "120"  # eight ranks' imports on two loaded cores


def session(gpus_per_task):
    conf = {"spark.ui.enabled": "false", "spark.ui.showConsoleProgress": "false", "spark.driver.host": "hosta",
            "spark.driver.bindAddress": "10.99.0.2", "spark.pyspark.python": sys.executable,
            "spark.executorEnv.PYSPARK_PYTHON": sys.executable, "spark.executor.cores": "2",
            "spark.executor.memory": "1g", "spark.cores.max": "4", "spark.executor.resource.gpu.amount": "4",
            "spark.task.resource.gpu.amount": str(gpus_per_task),
            "spark.executor.resource.gpu.discoveryScript": script,
            "spark.scheduler.minRegisteredResourcesRatio": "1.0",
            "spark.scheduler.maxRegisteredResourcesWaitingTime": "120s"}
    builder = SparkSession.builder.master(master).appName(f"phalanx-hosts-{gpus_per_task}-gpus")
    for k, v in conf.items():
        builder = builder.config(k, v)
    spark = builder.getOrCreate()
    sc = spark.sparkContext
    sc.setLogLevel("ERROR")
    slots = 4 // gpus_per_task  # the executors of this application start now: wait for them, warm them up
    deadline = time.monotonic() + 180
    while task_slots(sc) < slots:
        if time.monotonic() > deadline:
            raise RuntimeError(f"{slots} task slots not registered within 180 s: {task_slots(sc)}")
        time.sleep(0.3)
    sc.parallelize(range(slots), slots).barrier().mapPartitions(lambda it: [0]).collect()
    return spark


KEYS = ("RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "HOROVOD_CROSS_RANK", "HOROVOD_CROSS_SIZE", "HOROVOD_HOSTNAME",
        "CUDA_VISIBLE_DEVICES", "PHALANX_PARENT_PID")

def train(out_dir, dies):
    import socket
    import phalanx.torch as hvd
    hvd.init()
    mine = {**{k: os.environ.get(k) for k in KEYS}, "local_rank": hvd.local_rank(), "size": hvd.size(),
            "cross_rank": hvd.cross_rank(), "pid": os.getpid(), "host": socket.gethostname(),
            "own_gpu": os.environ["CUDA_VISIBLE_DEVICES"].split(",")[hvd.local_rank()]}
    gathered = hvd.allgather_object(mine)
    if dies is None:
        return gathered
    if hvd.rank() == 0:
        Path(out_dir, "ranks.tmp").write_text(json.dumps(gathered))
        Path(out_dir, "ranks.tmp").rename(Path(out_dir, "ranks.json"))
    hvd.barrier()  # the file is written before rank `dies` dies
    if hvd.rank() == dies:
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(120)  # under test: the other ranks run until rank `dies`'s failure stops them

spark = session(2)  # 4 tasks of 2 GPUs: two on each host's executor
two = TorchDistributor(num_processes=8, local_mode=False, use_gpu=True).run(train, str(out), None)
(out / "two.json").write_text(json.dumps(two))
spark.stop()
spark = session(4)  # 2 tasks of 4 GPUs: one on each host
try:
    TorchDistributor(num_processes=8, local_mode=False, use_gpu=True).run(train, str(out), 6)
    print("RESULT " + json.dumps({"root": None}), flush=True)
except WorkerFailedError as e:
    print("RESULT " + json.dumps({"root": e.root_cause.rank, "host": e.root_cause.host, "report": str(e)}),
          flush=True)
spark.stop()
'''


def _spark_class() -> str:
    import pyspark

    return str(Path(pyspark.__file__).parent / "bin" / "spark-class")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait_for(path: Path, pattern: str, count: int, procs: list[subprocess.Popen[bytes]]) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while len(re.findall(pattern, path.read_text(errors="replace") if path.exists() else "")) < count:
        dead = [p for p in procs if p.poll() is not None]
        if dead or time.monotonic() > deadline:
            why = "a process exited" if dead else f"not within {START_TIMEOUT_S:g} s"
            text = path.read_text(errors="replace")[-3000:] if path.exists() else ""
            raise RuntimeError(f"the simulated-hosts Spark cluster did not start ({why}); {path.name}:\n{text}")
        time.sleep(0.3)


@contextmanager
def spark_on_hosts(cluster: Cluster, tmp: Path) -> Iterator[tuple[str, Path]]:
    """A standalone master on hosta and a worker (2 cores, 4 fake GPUs) on each host; its URL and the GPU
    discovery script. Everything is stopped at the end."""
    import pyspark

    script = tmp / "gpus.sh"
    script.write_text("#!/bin/sh\necho '{\"name\": \"gpu\", \"addresses\": " + json.dumps(list(GPUS)) + "}'\n")
    script.chmod(0o755)
    port = _free_port()
    url = f"spark://hosta:{port}"
    procs: list[subprocess.Popen[bytes]] = []
    base = dict(os.environ, SPARK_HOME=str(Path(pyspark.__file__).parent), PYSPARK_PYTHON=sys.executable,
                SPARK_NO_DAEMONIZE="1")
    try:
        for name, argv in [("master", ["org.apache.spark.deploy.master.Master", "--host", "hosta", "--port", str(port),
                                       "--webui-port", "0"])] + [
                (f"worker-{h}", ["org.apache.spark.deploy.worker.Worker", "--host", h, "--cores", "2", "--memory",
                                 "2g", "--webui-port", "0", "--work-dir", str(tmp / f"work-{h}"), url])
                for h in ("hosta", "hostb")]:
            host = "hosta" if name == "master" else name.split("-")[1]
            env = {**base, "SPARK_LOCAL_IP": cluster.hosts[host].address,
                   "SPARK_WORKER_OPTS": f"-Dspark.worker.resource.gpu.amount={len(GPUS)} "
                                        f"-Dspark.worker.resource.gpu.discoveryScript={script}"}
            with open(tmp / f"{name}.log", "wb") as log:
                procs.append(subprocess.Popen(cluster.argv_on(host, [_spark_class(), *argv], tmp), stdout=log,
                                              stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                                              start_new_session=True))
        _wait_for(tmp / "master.log", r"Registering worker", 2, procs)
        yield url, script
    finally:
        terminate_tree([p.pid for p in procs], 10.0)
        for p in procs:
            p.wait(timeout=30)


def _check_ranks(out: list[dict[str, Any]]) -> None:
    assert [o["RANK"] for o in out] == [str(r) for r in range(8)] and {o["size"] for o in out} == {8}
    # two tasks, one per host, each running four consecutive ranks
    assert [o["host"] for o in out] == [out[0]["host"]] * 4 + [out[4]["host"]] * 4
    assert {out[0]["host"], out[4]["host"]} == {"hosta", "hostb"}
    assert [o["HOROVOD_HOSTNAME"] for o in out] == [out[0]["HOROVOD_HOSTNAME"]] * 4 + [out[4]["HOROVOD_HOSTNAME"]] * 4
    assert out[0]["HOROVOD_HOSTNAME"] != out[4]["HOROVOD_HOSTNAME"]
    assert len({o["PHALANX_PARENT_PID"] for o in out[:4]}) == len({o["PHALANX_PARENT_PID"] for o in out[4:]}) == 1
    assert [o["LOCAL_RANK"] for o in out] == ["0", "1", "2", "3"] * 2 and {o["LOCAL_WORLD_SIZE"] for o in out} == {"4"}
    assert [o["local_rank"] for o in out] == [0, 1, 2, 3] * 2  # hvd.local_rank() is the device index
    assert [o["HOROVOD_CROSS_RANK"] for o in out] == ["0"] * 4 + ["1"] * 4
    assert [o["cross_rank"] for o in out] == [0] * 4 + [1] * 4 and {o["HOROVOD_CROSS_SIZE"] for o in out} == {"2"}
    # each rank's device is one of the GPUs Spark gave its task (not 0..3), never shared on a host
    assert {o["CUDA_VISIBLE_DEVICES"] for o in out} == {",".join(GPUS)}
    assert sorted((o["host"], o["own_gpu"]) for o in out) == sorted((h, g) for h in ("hosta", "hostb") for g in GPUS)


def _check_two_tasks_per_host(out: list[dict[str, Any]]) -> None:
    """Tasks of 2 GPUs, two tasks on each host's executor: a host's 4 ranks come from 2 tasks (their parent: the
    executor's one warm template, or, started cold, their task)."""
    assert [o["RANK"] for o in out] == [str(r) for r in range(8)] and {o["size"] for o in out} == {8}
    for task in range(4):  # a task runs two consecutive ranks
        first, second = out[2 * task], out[2 * task + 1]
        assert first["PHALANX_PARENT_PID"] == second["PHALANX_PARENT_PID"] and first["host"] == second["host"]
    for host in ("hosta", "hostb"):
        mine = [o for o in out if o["host"] == host]
        assert len(mine) == 4 and len({o["PHALANX_PARENT_PID"] for o in mine}) <= 2, mine
        assert sorted(o["local_rank"] for o in mine) == [0, 1, 2, 3] and {o["LOCAL_WORLD_SIZE"] for o in mine} == {"4"}
        assert [o["LOCAL_RANK"] for o in mine] == [str(o["local_rank"]) for o in mine]
        assert len({o["cross_rank"] for o in mine}) == 1
        # the host's ranks list the GPUs of both its tasks in local-rank order: each its own one
        assert len({o["CUDA_VISIBLE_DEVICES"] for o in mine}) == 1
        assert sorted(o["own_gpu"] for o in mine) == sorted(GPUS), mine
    assert {o["cross_rank"] for o in out} == {0, 1} and {o["HOROVOD_CROSS_SIZE"] for o in out} == {"2"}


def test_tasks_of_two_and_four_gpus_across_two_hosts_pin_every_rank_and_a_dying_rank_takes_its_task_down(
        cluster: Cluster, tmp_path: Path) -> None:
    (tmp_path / "driver.py").write_text(DRIVER)
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    with spark_on_hosts(cluster, tmp_path) as (url, script):
        done = cluster.run_on("hosta", [sys.executable, str(tmp_path / "driver.py"), url, str(script), str(out_dir)],
                              timeout=300, cwd=tmp_path)
        assert done.returncode == 0, done.stderr[-4000:] + done.stdout[-2000:]
        result = json.loads(done.stdout.split("RESULT ", 1)[1].splitlines()[0])
        _check_two_tasks_per_host(json.loads((out_dir / "two.json").read_text()))
        out = json.loads((out_dir / "ranks.json").read_text())
        _check_ranks(out)
        assert result["root"] == 6, result
        # named on its own host, not the driver's (hosta)
        assert result["host"] == out[6]["HOROVOD_HOSTNAME"] != out[0]["HOROVOD_HOSTNAME"], result
        assert "SIGKILL" in result["report"], result["report"]
        wait_until(lambda: not any(is_alive(o["pid"]) for o in out), 30, "every rank ended after the failure")
