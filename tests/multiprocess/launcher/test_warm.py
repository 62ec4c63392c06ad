"""Warm starts: later jobs fork from a pre-imported template, with the same guarantees as cold ones."""

from __future__ import annotations

import os
import signal
from typing import Any

import pytest
from tests.waits import wait_until

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


def _register_exit_hook(folder: str) -> int:
    import atexit

    rank = int(os.environ["RANK"])
    atexit.register(lambda: open(os.path.join(folder, f"rank{rank}.exited"), "w").close())
    return os.getppid()


@pytest.mark.timeout(120)
def test_a_warm_rank_runs_its_atexit_hooks_as_a_cold_one_does(tmp_path: Any) -> None:
    """A cold rank's interpreter runs atexit at exit (user hooks, TensorFlow's temporary-file removal)."""
    _warm_up()
    parents = phalanx.run(_register_exit_hook, args=(str(tmp_path),), np=2)
    assert set(parents) <= warm.template_pids()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rank0.exited", "rank1.exited"]


def _raise_or_die(how: str) -> None:
    import time

    if os.environ["RANK"] == "1":
        if how == "signal":
            os.kill(os.getpid(), signal.SIGKILL)
        raise KeyError("warm failure")
    time.sleep(60)  # under test: rank 0 runs until rank 1's failure stops it


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


def _leave_work_for_the_exit(folder: str) -> int:
    import atexit
    import threading
    import time

    rank = int(os.environ["RANK"])

    def late() -> None:
        time.sleep(0.2)  # under test: this thread outlives the function, and the rank's exit must join it
        open(os.path.join(folder, f"rank{rank}.thread"), "w").close()

    threading.Thread(target=late).start()  # not a daemon: the interpreter's exit waits for it
    atexit.register(lambda: open(os.path.join(folder, f"rank{rank}.exited"), "w").close())
    return os.getppid()


@pytest.mark.timeout(120)
def test_opt_out_starts_cold(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    _warm_up()
    monkeypatch.setenv("PHALANX_WARM_START", "0")
    assert set(phalanx.run(_leave_work_for_the_exit, args=(str(tmp_path),), np=2)) == {os.getpid()}
    # a cold rank ends as an interpreter does: its non-daemon threads joined, its atexit hooks run
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "rank0.exited", "rank0.thread", "rank1.exited", "rank1.thread"]


@pytest.mark.timeout(120)
def test_shutdown_leaves_nothing_and_the_next_job_forks_from_a_new_template() -> None:
    _warm_up()
    (pid,) = warm.template_pids()
    warm.shutdown()
    assert warm.template_pids() == set()
    assert not os.path.exists(f"/proc/{pid}") or open(f"/proc/{pid}/stat").read().split()[2] == "Z"
    parents = set(phalanx.run(os.getppid, np=2))
    assert parents == warm.template_pids() and pid not in parents


def _identity() -> dict[str, Any]:
    """What a rank must not share with its siblings, or get from the template instead of its job."""
    import random
    import threading

    import numpy as np
    import torch

    return {
        "ppid": os.getppid(), "pid": os.getpid(), "sid": os.getsid(0),
        "draws": (random.random(), float(torch.rand(1)), float(np.random.rand())),
        "threads": sorted(t.name for t in threading.enumerate()),
        "signals": (signal.getsignal(signal.SIGINT) is signal.default_int_handler,
                    signal.getsignal(signal.SIGTERM) == signal.SIG_DFL),
        "env": (os.environ.get("PHALANX_TEST_JOB_VAR"), os.environ.get("PHALANX_TEST_DRIVER_VAR"), os.environ["RANK"]),
        "sockets": sorted(os.readlink(f"/proc/self/fd/{fd}").split(":")[0] for fd in os.listdir("/proc/self/fd")
                          if os.path.exists(f"/proc/self/fd/{fd}") and "socket" in os.readlink(f"/proc/self/fd/{fd}")),
    }


@pytest.mark.timeout(180)
def test_a_drivers_first_job_forks_its_ranks_as_independent_as_cold_ones(monkeypatch: pytest.MonkeyPatch) -> None:
    """The first function job of a driver imports torch once, in a template it starts, and forks its ranks
    from it; each is as much its own process as a cold rank: its own pid and session, the job's
    environment (not the template's), default signal handlers, its own Python / torch / numpy random
    draws, and the same threads and sockets as a cold rank."""
    warm.shutdown()
    monkeypatch.setenv("PHALANX_TEST_DRIVER_VAR", "driver")
    # a start timeout that outlasts the template's imports on a loaded host (else the ranks start cold)
    forked = phalanx.run(_identity, np=3, env={"PHALANX_TEST_JOB_VAR": "job"}, start_timeout=150)
    (template,) = warm.template_pids()
    monkeypatch.setenv("PHALANX_WARM_START", "0")
    cold = phalanx.run(_identity, np=3, env={"PHALANX_TEST_JOB_VAR": "job"})
    assert {r["ppid"] for r in forked} == {template}
    assert {r["ppid"] for r in cold} == {os.getpid()}
    for ranks in (forked, cold):
        assert len({r["pid"] for r in ranks}) == 3 and all(r["sid"] == r["pid"] for r in ranks)
        for i in range(3):  # each generator draws differently in every rank
            assert len({r["draws"][i] for r in ranks}) == 3
        assert [r["env"] for r in ranks] == [("job", "driver", str(k)) for k in range(3)]
        assert all(r["signals"] == (True, True) for r in ranks)
    assert [r["threads"] for r in forked] == [r["threads"] for r in cold]
    assert [r["sockets"] for r in forked] == [r["sockets"] for r in cold]


def _fork_a_daemon(pidfile: str) -> int:
    """A daemon made by fork + setsid, with no exec: its /proc/<pid>/environ is the template's."""
    import time

    pid = os.fork()
    if pid == 0:
        os.setsid()
        try:
            time.sleep(300)  # under test: the daemon runs until the job's sweep ends it
        finally:
            os._exit(0)
    with open(pidfile + os.environ["RANK"], "w") as f:
        f.write(str(pid))
    return pid


@pytest.mark.timeout(120)
def test_a_daemon_forked_by_a_warm_rank_is_swept(tmp_path: Any) -> None:
    _warm_up()
    template = warm.template_pids()
    pids = phalanx.run(_fork_a_daemon, args=(str(tmp_path / "pid"),), np=2)
    assert warm.template_pids() == template  # the ranks were forked from the template
    for pid in pids:
        _wait_gone(pid)


def _wait_gone(pid: int) -> None:
    wait_until(lambda: not _alive(pid), 60, f"daemon {pid} of a warm rank ended (the job's sweep)")


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.timeout(180)
def test_the_template_outlives_the_thread_that_ran_the_job_before() -> None:
    """Linux sends the parent-death signal when the thread that forked a child exits: a template started
    after a job run in a helper thread died with that thread, and the next job's ranks with it."""
    import threading

    warm.shutdown()
    done: list[object] = []
    helper = threading.Thread(target=lambda: done.append(phalanx.run(os.getpid, np=1)))
    helper.start()  # its job starts cold, then the template is started when it ends
    helper.join(120)
    assert done and not helper.is_alive()
    template = warm.ready_template(timeout_s=60)
    assert template is not None, "the template died with the thread that ran the previous job"
    assert phalanx.run(os.getppid, np=2) == [template.proc.pid] * 2
