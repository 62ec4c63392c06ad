"""Elastic Spark jobs on the standalone cluster: a worker SIGKILLed at a random step is replaced in its slot
and the survivor keeps its work; a killed task (a lost executor) fails the stage, which is re-submitted and
resumes from the last durable commit."""

from __future__ import annotations

import random
import sys
from pathlib import Path
from typing import Any

import pytest

from phalanx.env import names as env_names
from phalanx.errors import WorkerFailedError
from phalanx.spark import HorovodRunner, TorchDistributor, run_elastic

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "multiprocess" / "elastic"))
import _digits_job as job

pytestmark = [pytest.mark.spark, pytest.mark.usefixtures("standalone_spark")]

STEPS, COMMIT_EVERY = 30, 5
ENV = {env_names.PHALANX_ELASTIC_TIMEOUT_S: "30"}


@pytest.fixture(scope="module")
def data() -> tuple[Any, Any]:
    return job.load_data()


@pytest.fixture(scope="module")
def undisturbed(data: tuple[Any, Any]) -> list[dict[str, Any]]:
    # TorchDistributor's elastic opt-in, undisturbed: rank 0's value.
    distributor = TorchDistributor(num_processes=2, local_mode=False, use_gpu=False, reset_limit=1)
    return [distributor.run(job.train, data, steps=STEPS, commit_every=COMMIT_EVERY)]


@pytest.mark.timeout(180)
def test_sigkilled_worker_is_replaced_and_the_survivor_keeps_its_work(
        data: tuple[Any, Any], undisturbed: list[dict[str, Any]], tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    rng = random.Random()
    kill_at, victim = rng.randrange(COMMIT_EVERY + 1, STEPS - 1), rng.randrange(2)
    kwargs: dict[str, Any] = {"steps": STEPS, "commit_every": COMMIT_EVERY, "kill_at": kill_at, "victim": victim,
                              "marker": str(tmp_path / "killed")}
    # No checkpoint_dir: a failed stage would not be re-submitted, so completing means the stage survived.
    out = run_elastic(job.train, (data,), kwargs, num_proc=2, reset_limit=1, env=ENV)
    assert (tmp_path / "killed").exists(), "the victim never died"
    # The start's progress, in order, then nothing more: the replacement's start is not the job's.
    steps = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("phalanx: ")]
    assert steps == ["phalanx: waiting for 2 barrier task(s) of Spark to start the ranks",
                     "phalanx: barrier tasks started 2/2", "phalanx: ranks started 2/2"], steps
    assert [r["rank"] for r in out] == [0, 1] and all(r["size"] == 2 for r in out)
    survivor = next(r for r in out if r["resumed_from"] == 0)  # started at step 0 and never restarted
    replacement = next(r for r in out if r is not survivor)
    lost = survivor["executed"] - STEPS
    assert 0 <= lost < COMMIT_EVERY, f"kill at step {kill_at} of rank {victim}: {lost} steps replayed"
    assert replacement["resumed_from"] == kill_at - lost > 0  # got the last commit from rank 0 via sync()
    assert replacement["executed"] == STEPS - replacement["resumed_from"]
    assert abs(out[0]["acc"] - undisturbed[0]["acc"]) <= 1.0, (kill_at, victim, out, undisturbed)


@pytest.mark.timeout(240)
def test_lost_task_resubmits_the_stage_from_the_last_durable_commit(
        data: tuple[Any, Any], undisturbed: list[dict[str, Any]], tmp_path: Path) -> None:
    kill_at = random.Random().randrange(COMMIT_EVERY + 1, STEPS - 1)
    kwargs: dict[str, Any] = {"steps": STEPS, "commit_every": COMMIT_EVERY, "kill_at": kill_at, "victim": 1,
                              "marker": str(tmp_path / "killed"), "kill_task": True}
    # Cold starts: the worker's parent is then its task (a warm-started worker's is the template).
    out = run_elastic(job.train, (data,), kwargs, num_proc=2, checkpoint_dir=str(tmp_path / "ckpt"),
                      reset_limit=2, env={**ENV, env_names.PHALANX_WARM_START: "0"})
    assert (tmp_path / "killed").exists()
    resumed = out[0]["resumed_from"]
    # The stage restarts from the last durable commit: at most one interval before the kill, or later when
    # the survivor went on alone and committed before Spark failed the stage.
    assert resumed > 0 and resumed % COMMIT_EVERY == 0 and kill_at - resumed < COMMIT_EVERY, (kill_at, resumed)
    assert [r["executed"] for r in out] == [STEPS - resumed] * 2
    assert abs(out[0]["acc"] - undisturbed[0]["acc"]) <= 1.0


@pytest.mark.timeout(120)
def test_reset_limit_zero_fails_with_the_root_cause(data: tuple[Any, Any], tmp_path: Path) -> None:
    kwargs = {"steps": 20, "kill_at": 3, "victim": 1, "marker": str(tmp_path / "killed")}
    with pytest.raises(WorkerFailedError) as info:  # HorovodRunner's elastic opt-in
        HorovodRunner(np=2, reset_limit=0, driver_log_verbosity="all").run(job.train, data=data, **kwargs)
    assert "SIGKILL" in str(info.value) and "reset_limit=0" in str(info.value)
    assert info.value.root_cause.rank == 1
