"""Warm starts: later jobs fork from a pre-imported template, with the same guarantees as cold ones."""

from __future__ import annotations

import os
import signal
from typing import Any

import pytest

import phalanx
from phalanx.errors import WorkerFailedError
from phalanx.launch import warm

pytestmark = [pytest.mark.multiprocess]


def _warm_up() -> None:
    """Make sure a template runs and is ready (the first job of a driver is cold)."""
    phalanx.run(os.getpid, np=1)
    assert warm.ready_template(timeout_s=60) is not None, "the warm-start template did not come up"


def _leave_state_behind() -> dict[str, Any]:
    import json

    import numpy as np
    import torch

    json.PHALANX_LEAK = 1  # type: ignore[attr-defined]
    torch.PHALANX_LEAK = 1  # type: ignore[attr-defined]
    os.environ["PHALANX_LEAK"] = "1"
    return {"ppid": os.getppid(), "draw": float(np.random.rand()), "cwd": os.getcwd()}


def _look_for_state() -> dict[str, Any]:
    import json

    import numpy as np
    import torch

    return {
        "ppid": os.getppid(),
        "json": hasattr(json, "PHALANX_LEAK"),
        "torch": hasattr(torch, "PHALANX_LEAK"),
        "env": "PHALANX_LEAK" in os.environ,
        "mine": os.environ.get("JOB_VAR"),
        "draw": float(np.random.rand()),
        "cwd": os.getcwd(),
        "threads": (torch.get_num_threads(), os.environ.get("OMP_NUM_THREADS")),
    }


@pytest.mark.timeout(120)
def test_a_job_cannot_see_a_previous_jobs_state(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    _warm_up()
    template = warm.template_pids()
    first = phalanx.run(_leave_state_behind, np=2)
    monkeypatch.chdir(tmp_path)
    second = phalanx.run(_look_for_state, np=2, env={"JOB_VAR": "second"})
    assert {r["ppid"] for r in first + second} <= template  # both jobs were forked from the template
    for r in second:
        assert (r["json"], r["torch"], r["env"], r["mine"]) == (False, False, False, "second")
        assert r["cwd"] == str(tmp_path)
        # OpenMP read the template's thread count at import; the rank must get its own share
        assert r["threads"] == (max(1, (os.cpu_count() or 1) // 2), str(max(1, (os.cpu_count() or 1) // 2)))
    draws = [r["draw"] for r in first + second]
    assert len(set(draws)) == len(draws), "numpy's generator was not reseeded in forked ranks"


def _raise_or_die(how: str) -> None:
    import time

    if os.environ["RANK"] == "1":
        if how == "signal":
            os.kill(os.getpid(), signal.SIGKILL)
        raise KeyError("warm failure")
    time.sleep(60)


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("how", "message"), [("raise", "KeyError: 'warm failure'"), ("signal", "SIGKILL")])
def test_failures_are_reported_as_in_a_cold_start(how: str, message: str) -> None:
    _warm_up()
    with pytest.raises(WorkerFailedError, match=message) as info:
        phalanx.run(_raise_or_die, args=(how,), np=2)
    assert info.value.root_cause.rank == 1
    assert [f.rank for f in info.value.failures] == [1, 0]
    # the template survives a failed job and serves the next one
    assert phalanx.run(os.getppid, np=2) == [next(iter(warm.template_pids()))] * 2


@pytest.mark.timeout(120)
def test_opt_out_starts_cold(monkeypatch: pytest.MonkeyPatch) -> None:
    _warm_up()
    monkeypatch.setenv("PHALANX_WARM_START", "0")
    assert set(phalanx.run(os.getppid, np=2)) == {os.getpid()}


@pytest.mark.timeout(120)
def test_shutdown_leaves_nothing_and_the_next_job_starts_cold() -> None:
    _warm_up()
    (pid,) = warm.template_pids()
    warm.shutdown()
    assert warm.template_pids() == set()
    assert not os.path.exists(f"/proc/{pid}") or open(f"/proc/{pid}/stat").read().split()[2] == "Z"
    assert set(phalanx.run(os.getppid, np=2)) == {os.getpid()}
