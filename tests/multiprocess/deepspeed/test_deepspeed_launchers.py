"""DeepSpeed and Hugging Face scripts unchanged under phalanx's local launchers: ZeRO 1-3 in one job per
launcher; accelerate and transformers.Trainer (with DeepSpeed) in one job.

The phalanxrun job also starts with an empty torch extensions cache: DeepSpeed must not JIT-build its CPU
shared-memory op in every rank (phalanx.worker.deepspeed_ops).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import _zero_job as job
import pytest

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(240)]

JOB = Path(job.__file__)
HF_JOB = JOB.with_name("_hf_job.py")


def records(stdout: str) -> list[dict[str, Any]]:
    return [json.loads(line.partition("ZERO ")[2]) for line in stdout.splitlines() if "ZERO {" in line]


def test_phalanxrun_zero_1_2_3_with_an_empty_extensions_cache(tmp_path: Path) -> None:
    cache = tmp_path / "torch_extensions"
    env = dict(os.environ, TORCH_EXTENSIONS_DIR=str(cache))
    proc = subprocess.run([sys.executable, "-m", "phalanx.cli.main", "-np", "2", sys.executable, str(JOB)],
                          env=env, capture_output=True, text=True, timeout=220)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    got = records(proc.stdout)
    job.check(got, world=2)
    # No rank built DeepSpeed's CPU shm op: under phalanx it would never be initialized.
    assert not (cache / "deepspeed_shm_comm").exists(), sorted(p.name for p in cache.iterdir())
    assert {r["env"]["LOCAL_WORLD_SIZE"] for r in got} == {"2"}


def test_deepspeed_distributor_local_function_with_a_dict_config() -> None:
    """phalanx.run underneath; the function finds pyspark's flags in sys.argv and the dict in the file."""
    from phalanx.spark import DeepspeedTorchDistributor

    extra = {"gradient_clipping": 1.0, "wall_clock_breakdown": False}
    got = DeepspeedTorchDistributor(numGpus=2, nnodes=1, localMode=True, useGpu=False,
                                    deepspeedConfig=extra).run(job.train_from_argv)
    assert got["rank"] == 0 and got["deepspeed_flag"] and got["base"] == extra
    assert got["env"]["WORLD_SIZE"] == "2"
    job.check([got], world=2, ranks=[0])


def test_phalanxrun_accelerate_and_trainer_with_deepspeed() -> None:
    """Hugging Face scripts unchanged: accelerate and transformers place the rank from torchrun's variables."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    proc = subprocess.run([sys.executable, "-m", "phalanx.cli.main", "-np", "2", sys.executable, str(HF_JOB)],
                          env=env, capture_output=True, text=True, timeout=220)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    got = sorted((json.loads(line.partition("HF ")[2]) for line in proc.stdout.splitlines() if "HF {" in line),
                 key=lambda r: r["env"]["RANK"])
    assert [r["env"]["RANK"] for r in got] == ["0", "1"]
    acc = [r["accelerate"] for r in got]
    assert [(a["num_processes"], a["process_index"], a["local_process_index"]) for a in acc] == [(2, 0, 0), (2, 1, 1)]
    assert {a["distributed_type"] for a in acc} == {"DistributedType.MULTI_CPU"}
    assert acc[0]["param_sums"] == acc[1]["param_sums"] and len(acc[0]["param_sums"]) == 2  # in sync
    assert acc[0]["batches"] == 11  # the sampler shards 22 blocks over 2 ranks
    trainer = [r["trainer"] for r in got]
    assert [(t["world_size"], t["process_index"], t["steps"], t["deepspeed"]) for t in trainer] == [
        (2, 0, 3, True), (2, 1, 3, True)]
    assert trainer[0]["loss"] == trainer[1]["loss"]
    assert {r["env"]["LOCAL_WORLD_SIZE"] for r in got} == {"2"}
