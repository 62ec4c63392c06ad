"""run_elastic on the standalone cluster: a rank SIGKILLed mid-training; the re-submitted stage resumes
from the last durable commit."""

from __future__ import annotations

import random
import sys
from pathlib import Path
from typing import Any

import pytest

from phalanx.spark import run, run_elastic

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "multiprocess" / "elastic"))
import _digits_job as job

pytestmark = [pytest.mark.spark, pytest.mark.usefixtures("standalone_spark")]

STEPS, COMMIT_EVERY = 30, 5


@pytest.mark.timeout(300)
def test_sigkilled_rank_resumes_from_the_last_durable_commit(tmp_path: Path) -> None:
    data = job.load_data()
    base = run(job.train, (data,), {"steps": STEPS, "commit_every": COMMIT_EVERY}, num_proc=2)
    kill_at = random.Random().randrange(COMMIT_EVERY + 1, STEPS - 1)
    kwargs: dict[str, Any] = {"steps": STEPS, "commit_every": COMMIT_EVERY, "kill_at": kill_at, "victim": 1,
                              "marker": str(tmp_path / "killed")}
    out = run_elastic(job.train, (data,), kwargs, num_proc=2, checkpoint_dir=str(tmp_path / "ckpt"),
                      reset_limit=2)
    assert (tmp_path / "killed").exists()
    resumed = out[0]["resumed_from"]
    assert resumed > 0 and 0 <= kill_at - resumed < COMMIT_EVERY, (kill_at, resumed)
    assert [r["executed"] for r in out] == [STEPS - resumed] * 2
    assert abs(out[0]["acc"] - base[0]["acc"]) <= 1.0
