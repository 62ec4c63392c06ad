"""Several GPUs per Spark task, as pyspark's TorchDistributor runs them: on the standalone cluster whose tasks
hold 2 fake GPUs each (addresses "3" and "5" on each of the 2 worker hosts), 4 ranks run as 2 tasks of 2."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest
from tests.waits import wait_until

from phalanx.errors import InvalidArgumentError, SlotsUnavailableError, WorkerFailedError
from phalanx.launch.proctree import is_alive
from phalanx.spark import TorchDistributor, run

pytestmark = [pytest.mark.spark, pytest.mark.usefixtures("standalone_spark_two_gpus_per_task")]

KEYS = ("RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "HOROVOD_CROSS_RANK", "HOROVOD_HOSTNAME", "CUDA_VISIBLE_DEVICES",
        "PHALANX_PARENT_PID")


def _pinned_then_rank_3_dies(out_dir: str) -> None:
    """Every rank's identity, its own GPU (``cuda:LOCAL_RANK``) and its task's pid, gathered over the 4 ranks and
    written by rank 0; then rank 3 dies by SIGKILL while the others sleep."""
    import phalanx.torch as hvd

    hvd.init()
    mine = {**{k: os.environ.get(k) for k in KEYS}, "local_rank": hvd.local_rank(), "size": hvd.size(),
            "pid": os.getpid(), "own_gpu": os.environ["CUDA_VISIBLE_DEVICES"].split(",")[hvd.local_rank()],
            "parent": Path(f"/proc/{os.getppid()}/cmdline").read_bytes().replace(b"\0", b" ").decode()}
    gathered = hvd.allgather_object(mine)
    if hvd.rank() == 0:
        Path(out_dir, "ranks.tmp").write_text(json.dumps(gathered))
        Path(out_dir, "ranks.tmp").rename(Path(out_dir, "ranks.json"))
    hvd.barrier()  # the file is written before rank 3 dies
    if hvd.rank() == 3:  # as torch's NCCL watchdog would, it leaves its Flight Recorder dump first
        with open(os.environ["TORCH_FR_DUMP_TEMP_FILE"] + "3", "wb") as f:
            __import__("pickle").dump({"version": "2.10", "entries": [{"collective_seq_id": 9, "state": "started",
                                                                      "profiling_name": "nccl:all_reduce"}]}, f)
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(120)  # under test: the other ranks run until rank 3's failure stops them


def _check_pinned(out: list[dict[str, Any]]) -> None:
    assert [o["RANK"] for o in out] == ["0", "1", "2", "3"] and {o["size"] for o in out} == {4}
    # two tasks (one per host), each running two consecutive ranks
    assert len({o["PHALANX_PARENT_PID"] for o in out}) == 2
    assert out[0]["PHALANX_PARENT_PID"] == out[1]["PHALANX_PARENT_PID"]
    assert out[0]["HOROVOD_HOSTNAME"] == out[1]["HOROVOD_HOSTNAME"] != out[2]["HOROVOD_HOSTNAME"]
    assert [o["LOCAL_RANK"] for o in out] == ["0", "1", "0", "1"] and {o["LOCAL_WORLD_SIZE"] for o in out} == {"2"}
    assert [o["HOROVOD_CROSS_RANK"] for o in out] == ["0", "0", "1", "1"]
    assert [o["local_rank"] for o in out] == [0, 1, 0, 1]  # hvd.local_rank() is the device index
    # each rank's device is one of the GPUs Spark gave its task (not 0..k-1), never shared
    assert {o["CUDA_VISIBLE_DEVICES"] for o in out} == {"3,5"}
    assert {(o["HOROVOD_HOSTNAME"], o["own_gpu"]) for o in out} == {
        (h, g) for h in ("127.0.0.1", "127.0.0.2") for g in ("3", "5")}


@pytest.mark.timeout(150)
def test_torch_distributor_runs_k_ranks_per_task_pinned_and_a_dying_rank_takes_its_task_down(tmp_path: Path) -> None:
    with pytest.raises(InvalidArgumentError, match=r"num_processes \(3\) must be a multiple of "
                                                   r"'spark.task.resource.gpu.amount' \(2\)"):
        TorchDistributor(num_processes=3, local_mode=False, use_gpu=True).run(_pinned_then_rank_3_dies, "")
    with pytest.raises(WorkerFailedError) as info:
        TorchDistributor(num_processes=4, local_mode=False, use_gpu=True).run(_pinned_then_rank_3_dies,
                                                                               str(tmp_path))
    assert info.value.root_cause.rank == 3, str(info.value)
    assert "SIGKILL" in str(info.value)
    # the task that ran rank 3 read its dump and sent it with the rank's last lines
    assert "phalanx: torch's Flight Recorder dump of rank 3" in str(info.value), str(info.value)
    assert "#9 nccl:all_reduce on group ? (started)" in str(info.value)
    kept = str(info.value).split("(written by NCCL's watchdog; kept at ", 1)[1].split(")", 1)[0].split(":", 1)[1]
    os.unlink(kept)
    os.rmdir(os.path.dirname(kept))
    out = json.loads((tmp_path / "ranks.json").read_text())
    _check_pinned(out)
    # The fresh executors' first job: each task's two ranks forked from the one template its task started (one
    # import of torch per executor; issue 36), not started as interpreters.
    assert all("phalanx.worker.template" in o["parent"] for o in out), [o["parent"] for o in out]
    wait_until(lambda: not any(is_alive(o["pid"]) for o in out), 60, "every rank ended after the failure")


@pytest.mark.timeout(60)
def test_the_slot_check_counts_tasks_of_two_gpus() -> None:
    with pytest.raises(SlotsUnavailableError) as info:
        run(lambda: None, num_proc=6, start_timeout=1)
    message = str(info.value)
    assert "6 ranks (3 tasks of 2 GPUs each) were asked for" in message and "only 2 task(s)" in message


def _deepspeed_identity() -> list[dict[str, Any]]:
    import phalanx.torch as hvd

    hvd.init()
    mine = {**{k: os.environ.get(k) for k in KEYS}, "local_rank": hvd.local_rank(), "size": hvd.size(),
            "pid": os.getpid(), "own_gpu": os.environ["CUDA_VISIBLE_DEVICES"].split(",")[hvd.local_rank()],
            "flag": "--deepspeed" in __import__("sys").argv}
    return hvd.allgather_object(mine)


@pytest.mark.timeout(120)
def test_deepspeed_distributor_runs_num_gpus_ranks_per_task_of_num_gpus() -> None:
    """DeepspeedTorchDistributor(numGpus=2, nnodes=2) on tasks of 2 GPUs: one task per node, 2 ranks each."""
    from phalanx.spark import DeepspeedTorchDistributor

    with pytest.raises(InvalidArgumentError, match=r"numGpus=3, nnodes=1\) runs num_processes=3 ranks: .*multiple"):
        DeepspeedTorchDistributor(numGpus=3, nnodes=1, localMode=False, useGpu=True).run(_deepspeed_identity)
    out = DeepspeedTorchDistributor(numGpus=2, nnodes=2, localMode=False, useGpu=True).run(_deepspeed_identity)
    _check_pinned(out)
    assert {o["flag"] for o in out} == {True}
