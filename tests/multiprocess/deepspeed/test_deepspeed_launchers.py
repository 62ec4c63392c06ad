"""DeepSpeed and Hugging Face scripts unchanged under phalanx's local launchers: ZeRO 1-3 in one job per
launcher; an accelerate script. (Trainer with DeepSpeed: examples/hf_trainer_tiny.py.)

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


def test_phalanxrun_accelerate() -> None:
    """An accelerate script unchanged: accelerate places the rank from torchrun's variables (and sizes its
threads by LOCAL_WORLD_SIZE)."""
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
    assert {r["env"]["LOCAL_WORLD_SIZE"] for r in got} == {"2"}
