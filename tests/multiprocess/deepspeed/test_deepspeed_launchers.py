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


def test_deepspeed_distributor_local_function_with_a_dict_config() -> None:
    """phalanx.run underneath; the function finds pyspark's flags in sys.argv and the dict in the file."""
    from phalanx.spark import DeepspeedTorchDistributor

    extra = {"gradient_clipping": 1.0, "wall_clock_breakdown": False}
    got = DeepspeedTorchDistributor(numGpus=2, nnodes=1, localMode=True, useGpu=False,
                                    deepspeedConfig=extra).run(job.train_from_argv)
    assert got["rank"] == 0 and got["deepspeed_flag"] and got["base"] == extra
    assert got["env"]["WORLD_SIZE"] == "2"
    job.check([got], world=2, ranks=[0])
