"""DeepSpeed scripts unchanged under phalanx's local launchers: ZeRO 1-3 in one job per launcher.

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
