"""Elastic local jobs: SIGKILL a rank mid-training, the job completes with the work since one commit lost."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import _digits_job as job
import pytest

import phalanx
from phalanx.env import names as env_names
from phalanx.errors import WorkerFailedError

STEPS = 40
COMMIT_EVERY = 5
ENV = {env_names.PHALANX_ELASTIC_TIMEOUT_S: "30"}


@pytest.fixture(scope="module")
def data() -> tuple[Any, Any]:
    return job.load_data()


@pytest.fixture(scope="module")
def undisturbed(data: tuple[Any, Any]) -> list[dict[str, Any]]:
    return phalanx.run(job.train, (data,), {"steps": STEPS, "commit_every": COMMIT_EVERY}, np=2)


@pytest.mark.timeout(120)
def test_sigkill_at_a_random_step_loses_at_most_one_commit_interval(
        data: tuple[Any, Any], undisturbed: list[dict[str, Any]], tmp_path: Path) -> None:
    rng = random.Random()
    kill_at, victim = rng.randrange(2, STEPS - 2), rng.randrange(2)
    kwargs = {"steps": STEPS, "commit_every": COMMIT_EVERY, "kill_at": kill_at, "victim": victim,
              "marker": str(tmp_path / "killed")}
    out = phalanx.run(job.train, (data,), kwargs, np=2, min_np=1, max_np=2, reset_limit=3, env=ENV)
    assert (tmp_path / "killed").exists(), "the victim never died"
    assert [r["rank"] for r in out] == [0, 1] and all(r["size"] == 2 for r in out)
    lost = max(r["executed"] for r in out) - STEPS
    assert 0 <= lost < COMMIT_EVERY, f"kill at step {kill_at} of rank {victim}: {lost} steps replayed"
    assert abs(out[0]["acc"] - undisturbed[0]["acc"]) <= 1.0, (kill_at, victim, out, undisturbed)


@pytest.mark.timeout(120)
def test_distributed_optimizer_survives_a_kill_mid_step(
        data: tuple[Any, Any], undisturbed: list[dict[str, Any]], tmp_path: Path) -> None:
    kill_at = random.Random().randrange(2, STEPS - 2)
    kwargs = {"steps": STEPS, "commit_every": COMMIT_EVERY, "kill_at": kill_at, "victim": 1,
              "marker": str(tmp_path / "killed"), "distributed_optimizer": True}
    out = phalanx.run(job.train, (data,), kwargs, np=2, min_np=1, reset_limit=3, env=ENV)
    assert (tmp_path / "killed").exists() and all(r["size"] == 2 for r in out)
    assert 0 <= max(r["executed"] for r in out) - STEPS < COMMIT_EVERY
    assert abs(out[0]["acc"] - undisturbed[0]["acc"]) <= 1.0, (kill_at, out, undisturbed)


@pytest.mark.timeout(90)
def test_reset_limit_zero_fails_with_the_root_cause(data: tuple[Any, Any], tmp_path: Path) -> None:
    kwargs = {"steps": 20, "kill_at": 3, "victim": 1, "marker": str(tmp_path / "killed")}
    with pytest.raises(WorkerFailedError) as info:
        phalanx.run(job.train, (data,), kwargs, np=2, min_np=1, reset_limit=0, env=ENV)
    assert "SIGKILL" in str(info.value) and "reset_limit=0" in str(info.value)
    assert info.value.root_cause.rank == 1


@pytest.mark.timeout(90)
def test_durable_commit_lets_a_restarted_job_resume(data: tuple[Any, Any], tmp_path: Path) -> None:
    env = {**ENV, env_names.PHALANX_ELASTIC_CHECKPOINT_DIR: str(tmp_path / "ckpt")}
    first = phalanx.run(job.train, (data,), {"steps": 20}, np=2, min_np=1, env=env)
    assert (tmp_path / "ckpt" / "state.pt").exists() and first[0]["executed"] == 20
    second = phalanx.run(job.train, (data,), {"steps": 30}, np=2, min_np=1, env=env)
    assert [r["executed"] for r in second] == [10, 10]


def _raises_everywhere(step: int) -> None:
    import torch

    import phalanx.torch as hvd

    hvd.init()
    state = hvd.elastic.ObjectState(step=0)

    @hvd.elastic.run
    def loop(state: hvd.elastic.ObjectState) -> None:
        while True:
            hvd.allreduce(torch.ones(1))
            state.step += 1
            if state.step == step:
                raise ValueError(f"bad batch at step {step}")

    loop(state)


@pytest.mark.timeout(90)
def test_a_deterministic_error_on_every_rank_fails_without_a_reset_limit() -> None:
    with pytest.raises(WorkerFailedError, match="bad batch at step 3") as info:
        phalanx.run(_raises_everywhere, (3,), np=2, min_np=1, env=ENV)
    assert "holds the training state" in str(info.value)


@pytest.mark.timeout(90)
def test_horovod_runner_on_the_driver_opts_in_with_reset_limit(data: tuple[Any, Any], tmp_path: Path) -> None:
    from phalanx.spark import HorovodRunner

    kwargs = {"steps": 20, "commit_every": COMMIT_EVERY, "kill_at": 12, "victim": 1, "marker": str(tmp_path / "killed")}
    out = HorovodRunner(np=-2, reset_limit=1, checkpoint_dir=str(tmp_path / "ckpt")).run(job.train, data=data, **kwargs)
    assert (tmp_path / "killed").exists() and out["size"] == 2 and out["executed"] == 20 + 12 - 10
    assert (tmp_path / "ckpt" / "state.pt").exists()


def _grows(marker: str, steps: int) -> dict[str, Any]:
    import time

    import torch

    import phalanx.torch as hvd

    hvd.init()
    state = hvd.elastic.ObjectState(step=0, total=0.0)
    executed = [0]

    @hvd.elastic.run
    def loop(state: hvd.elastic.ObjectState) -> float:
        while state.step < steps:
            state.total += float(hvd.allreduce(torch.ones(1), op=hvd.Sum))  # adds the world's size
            state.step += 1
            executed[0] += 1
            if state.step == 5 and hvd.size() == 2:
                if hvd.rank() == 0:
                    Path(marker).write_text("3")  # the discovery script now reports 3 slots
                give_up = time.monotonic() + 30
                while time.monotonic() < give_up:
                    state.commit()  # raises HostsUpdatedInterrupt once the driver published the bigger world
                    time.sleep(0.1)
                raise RuntimeError("the driver did not grow the world within 30 s")
            if state.step % 5 == 0:
                state.commit()
        return float(state.total)

    total = loop(state)
    return {"rank": hvd.rank(), "size": hvd.size(), "total": total, "executed": executed[0]}


@pytest.mark.timeout(90)
def test_host_discovery_grows_the_world_without_losing_work(tmp_path: Path) -> None:
    slots = tmp_path / "slots"
    script = tmp_path / "discover.sh"
    script.write_text(f'#!/bin/sh\necho "localhost:$(cat {slots} 2>/dev/null || echo 2)"\necho "elsewhere:4"\n')
    script.chmod(0o755)
    out = phalanx.run(_grows, (str(slots), 10), np=2, max_np=3, host_discovery_script=str(script), env=ENV)
    assert [r["rank"] for r in out] == [0, 1, 2] and all(r["size"] == 3 for r in out)
    assert all(r["total"] == 5 * 2 + 5 * 3 for r in out)  # steps 1-5 on 2 ranks, 6-10 on 3, none replayed
    assert sorted(r["executed"] for r in out) == [5, 10, 10]  # the new worker ran only steps 6-10
