"""phalanx.spark on a real Spark standalone cluster: 2 workers ("hosts" 127.0.0.1 and 127.0.0.2) x 2 cores."""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from tests.waits import wait_until

from phalanx.errors import SlotsUnavailableError, SparkJobError, WorkerFailedError
from phalanx.launch.proctree import is_alive
from phalanx.spark import TorchDistributor, run

pytestmark = [pytest.mark.spark, pytest.mark.usefixtures("standalone_spark")]
WAIT_S = 60.0  # bounds waits that end much sooner (generous: a loaded host); a failure names it

KEYS = ["RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE", "HOROVOD_CROSS_RANK",
        "HOROVOD_CROSS_SIZE", "HOROVOD_HOSTNAME", "CUDA_VISIBLE_DEVICES", "USER_VAR"]


def _identity() -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    backend = f"{dist.get_backend()} {dist.get_backend_config()}"
    pg = dist.distributed_c10d._get_default_group()
    t = torch.ones(1)
    dist.all_reduce(t)
    shm = dict(getattr(pg, "shm_calls", {}))
    dist.destroy_process_group()
    return {"sum": t.item(), "python": sys.executable, "backend": backend, "shm": shm,
            **{k: os.environ.get(k) for k in KEYS}}


def _check_identities(out: list[dict[str, Any]]) -> None:
    """Four ranks, two per worker: the allreduce, the backend, the interpreter, the env and the local and
    cross ranks."""
    assert len(out) == 4 and {o["sum"] for o in out} == {4.0}
    # two hosts, two ranks each: the gloo request gets the hierarchical phalanx_shm group (shm within a host)
    assert {o["backend"] for o in out} == {"gloo cpu:phalanx_shm,cuda:gloo"}
    assert all(o["shm"].get("allreduce") == 1 for o in out), [o["shm"] for o in out]
    assert {o["python"] for o in out} == {sys.executable}, "executors must run the driver's interpreter"
    assert {o["USER_VAR"] for o in out} == {"v"}
    # Each task holds one of its host's GPUs: run() pins every rank (cuda:LOCAL_RANK is its own GPU).
    assert {o["CUDA_VISIBLE_DEVICES"] for o in out} == {"3,5"}
    by_host: dict[str, list[dict[str, Any]]] = {}
    for o in out:
        by_host.setdefault(o["HOROVOD_HOSTNAME"], []).append(o)
    assert sorted(by_host) == ["127.0.0.1", "127.0.0.2"]
    host_ranks = {h: ranks[0]["GROUP_RANK"] for h, ranks in by_host.items()}
    assert sorted(host_ranks.values()) == ["0", "1"]
    for host, ranks in by_host.items():
        assert sorted(o["LOCAL_RANK"] for o in ranks) == ["0", "1"]
        assert {o["LOCAL_WORLD_SIZE"] for o in ranks} == {"2"} and {o["GROUP_WORLD_SIZE"] for o in ranks} == {"2"}
        # Horovod's cross rank: the host's index among hosts holding that local rank.
        assert {o["HOROVOD_CROSS_RANK"] for o in ranks} == {host_ranks[host]}
        assert {o["HOROVOD_CROSS_SIZE"] for o in ranks} == {"2"}


@pytest.mark.timeout(180)
def test_use_gpu_gives_each_rank_its_tasks_gpu() -> None:
    visible, gpus = TorchDistributor(num_processes=4, local_mode=False, use_gpu=True).run(_all_gpus)
    assert visible == "3,5"  # rank 0 sees both GPUs of its host, in local-rank order
    assert sorted(gpus) == [("127.0.0.1", "3"), ("127.0.0.1", "5"), ("127.0.0.2", "3"), ("127.0.0.2", "5")]


def _all_gpus() -> tuple[str, list[tuple[str, str]]]:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    own_gpu = os.environ["CUDA_VISIBLE_DEVICES"].split(",")[int(os.environ["LOCAL_RANK"])]  # cuda:LOCAL_RANK
    mine = f"{os.environ['HOROVOD_HOSTNAME']}|{own_gpu}"
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    dist.destroy_process_group()
    del torch
    return os.environ["CUDA_VISIBLE_DEVICES"], [tuple(g.split("|")) for g in gathered]  # type: ignore[misc]


def _identity_then_fail_on_rank_3(pid_dir: str) -> None:
    """Every rank reports its identity (``_identity``, one allreduce over the 4 ranks) to a file; rank 3 then
    fails once every rank has written it, while the others sleep."""
    Path(pid_dir, os.environ["RANK"]).write_text(str(os.getpid()))
    report = Path(pid_dir, f"identity-{os.environ['RANK']}.json")
    report.with_suffix(".tmp").write_text(json.dumps(_identity()))
    report.with_suffix(".tmp").rename(report)  # whole, for rank 3 and the test
    if os.environ["RANK"] == "3":
        deadline = time.monotonic() + WAIT_S
        while len(list(Path(pid_dir).glob("identity-*.json"))) < 4:
            if time.monotonic() > deadline:
                raise TimeoutError(f"not every rank wrote its identity within {WAIT_S:g} s")
            time.sleep(0.05)
        raise RuntimeError("rank 3 ran out of patience")
    time.sleep(120)  # under test: the other ranks run until rank 3's failure stops them


@pytest.mark.timeout(180)
def test_four_ranks_two_per_worker_then_a_failure_tears_down_every_rank(tmp_path: Path) -> None:
    """One job of 4 ranks on the 2 workers: each checks its identity (local and cross ranks, backend, env),
    then rank 3 fails and every rank is torn down."""
    with pytest.raises(WorkerFailedError) as info:
        run(_identity_then_fail_on_rank_3, args=(str(tmp_path),), num_proc=4, env={"USER_VAR": "v"})
    assert info.value.root_cause.rank == 3
    assert "RuntimeError: rank 3 ran out of patience" in str(info.value)
    _check_identities([json.loads(p.read_text()) for p in sorted(tmp_path.glob("identity-*.json"))])
    pids = [int(p.read_text()) for p in tmp_path.iterdir() if p.name.isdigit()]
    assert len(pids) == 4
    wait_until(lambda: not any(is_alive(p) for p in pids), WAIT_S, "every rank on the executors ended")
    # the cluster is usable again: the tests after this one run their jobs on all 4 slots


@pytest.mark.timeout(120)
def test_slot_shortage_on_a_cluster_waits_then_fails_with_the_numbers() -> None:
    started = time.monotonic()
    with pytest.raises(SlotsUnavailableError) as info:
        run(lambda: None, num_proc=5, start_timeout=2)
    message = str(info.value)
    assert "5 ranks were asked for" in message and "only 4 task(s)" in message
    assert "spark.task.resource.gpu.amount=1" in message and "start_timeout" in message
    assert time.monotonic() - started < 60


@pytest.mark.timeout(240)
def test_torch_estimator_on_the_cluster(standalone_spark: Any, tmp_path: Path) -> None:
    """TorchEstimator over 4 ranks on 2 workers: a store is required on a cluster; equal steps on every
    rank; transform runs on the executors."""
    pytest.importorskip("pyarrow")
    import torch
    from pyspark.ml.linalg import Vectors

    from phalanx.errors import InvalidArgumentError
    from phalanx.spark.torch import LocalStore, TorchEstimator

    rows = [(Vectors.dense([float(i % 3), float(i % 5)]), float(i % 3)) for i in range(90)]
    df = standalone_spark.createDataFrame(rows, ["x", "y"])
    model = torch.nn.Linear(2, 1)
    kwargs: dict[str, Any] = dict(num_proc=4, model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.05),
                                  loss=lambda out, y: torch.nn.functional.mse_loss(out[:, 0], y),
                                  feature_cols=["x"], label_cols=["y"], batch_size=4, epochs=1, verbose=0)
    with pytest.raises(InvalidArgumentError, match="store=None on the cluster"):
        TorchEstimator(**kwargs).fit(df)
    trained = TorchEstimator(store=LocalStore(str(tmp_path)), **kwargs).fit(df)
    assert trained.getHistory()[0]["steps_per_rank"] == [5, 5, 5, 5]
    out = trained.transform(df.limit(6)).collect()
    assert len(out) == 6 and all(isinstance(r["y__output"], float) for r in out)


def _executor_jvm() -> int:
    """The pid of the Spark executor JVM this rank runs under (its nearest ``java`` ancestor; a rank forked from
    its executor's shared template goes on from the template's owner, its executor's pyspark daemon)."""
    pid = os.getppid()
    while pid > 1:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            argv = f.read().split(b"\0")
        if any(b"CoarseGrainedExecutorBackend" in a for a in argv):
            return pid
        if b"phalanx.worker.template_shared" in argv:  # ... -m phalanx.worker.template_shared FD OWNER ...
            pid = int(argv[argv.index(b"phalanx.worker.template_shared") + 2])
            continue
        with open(f"/proc/{pid}/stat") as f:
            pid = int(f.read().rsplit(")", 1)[1].split()[1])
    raise RuntimeError("no executor JVM above this rank")


def _lose_my_executor(pid_dir: str) -> None:
    mine = Path(pid_dir, f".{os.environ['RANK']}")
    forked = b"phalanx.worker.template_shared" in Path(f"/proc/{os.getppid()}/cmdline").read_bytes()
    mine.write_text(f"{os.getpid()} {os.environ['HOROVOD_HOSTNAME']} {os.getppid()} {forked}")
    mine.rename(Path(pid_dir, os.environ["RANK"]))  # whole, for the peers that read it
    deadline = time.monotonic() + WAIT_S  # once every rank runs (some may start later)
    while len(written := [p for p in Path(pid_dir).iterdir() if p.name.isdigit()]) < 4:
        if time.monotonic() > deadline:
            raise TimeoutError(f"not every rank started within {WAIT_S:g} s")
        time.sleep(0.05)
    if os.environ["RANK"] == "0":
        os.kill(_executor_jvm(), signal.SIGKILL)  # a lost executor: Spark sees "exited with code 137"
    peers = [int(p.read_text().split()[0]) for p in written]
    deadline = time.monotonic() + WAIT_S
    while all(_exists(p) for p in peers):
        if time.monotonic() > deadline:
            raise TimeoutError(f"no peer died within {WAIT_S:g} s of the executor's SIGKILL")
        time.sleep(0.01)
    # a survivor notices its lost peers, as its collective would ("Connection closed by peer")
    raise ConnectionError("a peer is gone")


def _exists(pid: int) -> bool:
    """Whether ``pid`` is still there, a zombie included. A killed process's leader thread may be a zombie
    while its other threads, and so its sockets, live on for a few ms: a survivor's collective cannot
    see a peer gone before its sockets close, so neither may this test's survivor."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.mark.timeout(240)
def test_a_lost_executor_is_a_spark_job_error_naming_it(tmp_path: Path) -> None:
    """SIGKILL of the executor JVM holding rank 0: a SparkJobError naming the lost executor's host and exit
    code, with a rank of that executor (they died first), not a survivor that raised as soon as it saw a
    peer gone, as the root cause.

    Last in the module: the cluster has one executor fewer until its worker has started another."""
    with pytest.raises(SparkJobError) as info:
        run(_lose_my_executor, args=(str(tmp_path),), num_proc=4)
    ranks = {int(p.name): p.read_text().split() for p in tmp_path.iterdir() if p.name.isdigit()}
    host = ranks[0][1]
    lost = [r for r, written in ranks.items() if written[1] == host]  # rank 0 and its executor's other rank
    message = str(info.value)
    assert "exited with code 137" in message, message
    assert any(f"first to go: rank {r} on host {host}" in message for r in lost), message
    cause = info.value.__cause__
    assert isinstance(cause, WorkerFailedError) and cause.root_cause.rank in lost, cause
    assert cause.root_cause.exc_type == "phalanx.errors.SparkJobError", cause
    pids = [int(written[0]) for written in ranks.values()]
    wait_until(lambda: not any(is_alive(p) for p in pids), WAIT_S, "every rank ended (its executor's loss or teardown)")
    # the lost executor's warm template (its ranks' parent) ends with it
    template = int(ranks[0][2])
    assert ranks[0][3] == "True", "rank 0 did not fork from its executor's template"
    wait_until(lambda: not is_alive(template), WAIT_S, "the lost executor's template ended")
