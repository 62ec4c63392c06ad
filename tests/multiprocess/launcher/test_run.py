"""phalanx.run end to end: real worker processes, real gloo."""

from __future__ import annotations

import os
import re
import signal
import socket
import threading
import time
import traceback
from pathlib import Path
from typing import Any

import pytest
from tests.waits import wait_gone

import phalanx
from phalanx.errors import InvalidArgumentError, PayloadError, StartTimeoutError, WorkerFailedError

pytestmark = [pytest.mark.multiprocess]
# Bounds on waits that end much sooner (generous: the tests run on a loaded host); a failure names them.
WAIT_S = 30.0


def _wait_for_file(path: Path) -> None:
    """In a rank: wait for a peer rank's file (its handshake), up to WAIT_S."""
    deadline = time.monotonic() + WAIT_S
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} did not appear within {WAIT_S:g} s")
        time.sleep(0.01)


def _contract_and_allreduce() -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    t = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(t)
    dist.destroy_process_group()
    keys = ["RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "HOROVOD_RANK", "HOROVOD_SIZE",
            "HOROVOD_LOCAL_RANK", "HOROVOD_CROSS_RANK", "HOROVOD_CROSS_SIZE", "TORCHELASTIC_RUN_ID", "USER_VAR"]
    # rank 1's result is over the spool size: the driver gets it through a file (job/spool.py)
    big = bytes(range(256)) * (12 << 10) if os.environ["RANK"] == "1" else b""
    return {"sum": t.item(), "pid": os.getpid(), "big": big, **{k: os.environ.get(k) for k in keys}}


@pytest.mark.timeout(120)
def test_results_in_rank_order_with_the_full_contract(capfd: pytest.CaptureFixture[str]) -> None:
    out = phalanx.run(_contract_and_allreduce, np=3, env={"USER_VAR": "x"}, quiet=True)
    assert "phalanx: " not in capfd.readouterr().err  # quiet: no progress lines
    assert [o["RANK"] for o in out] == ["0", "1", "2"]
    assert {o["sum"] for o in out} == {6.0}
    assert [o["big"] for o in out] == [b"", bytes(range(256)) * (12 << 10), b""]
    assert len({o["pid"] for o in out} | {os.getpid()}) == 4
    for r, o in enumerate(out):
        assert o["LOCAL_RANK"] == o["HOROVOD_RANK"] == o["HOROVOD_LOCAL_RANK"] == str(r)
        assert (o["WORLD_SIZE"], o["LOCAL_WORLD_SIZE"], o["HOROVOD_SIZE"]) == ("3", "3", "3")
        assert (o["GROUP_RANK"], o["HOROVOD_CROSS_RANK"], o["HOROVOD_CROSS_SIZE"]) == ("0", "0", "1")
        assert o["USER_VAR"] == "x"
    assert len({o["TORCHELASTIC_RUN_ID"] for o in out}) == 1


def _chatty(lines: int) -> int:
    import sys

    rank = int(os.environ["RANK"])
    for i in range(lines):
        print(f"r{rank} line {i}")
    sys.stderr.write("E" * 100_000 + "\n")
    sys.stdout.write("last line without newline")
    return rank


@pytest.mark.timeout(120)
def test_every_log_line_arrives_in_order_and_whole(capfd: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    assert phalanx.run(_chatty, args=(5000,), np=2, output_filename=str(tmp_path)) == [0, 1]
    out, err = capfd.readouterr()
    # The start's progress: plain lines off a terminal, a count only once complete, never inside a rank's line.
    assert [ln for ln in err.splitlines() if "ranks started" in ln] == ["phalanx: ranks started 2/2"], err[:2000]
    for rank in (0, 1):
        mine = [ln for ln in out.splitlines() if ln.startswith(f"[{rank}]<stdout>:")]
        assert mine[:-1] == [f"[{rank}]<stdout>:r{rank} line {i}" for i in range(5000)]
        assert mine[-1] == f"[{rank}]<stdout>:last line without newline"
        assert f"[{rank}]<stderr>:" + "E" * 100_000 + "\n" in err
        kept = (tmp_path / f"rank.{rank}" / "stdout").read_text().splitlines()
        assert len(kept) == 5001 and kept[0] == f"r{rank} line 0"


def _fail_on_rank_1() -> None:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    print(f"rank {dist.get_rank()} ready", flush=True)
    if dist.get_rank() == 1:
        raise ValueError("rank one cannot go on")
    # rank 0 blocks here until it is torn down, or fails on its lost peer: either way after rank 1
    dist.all_reduce(torch.ones(1))


@pytest.mark.timeout(60)
def test_exception_names_root_cause_with_traceback_and_tears_down_blocked_ranks() -> None:
    with pytest.raises(WorkerFailedError) as info:
        phalanx.run(_fail_on_rank_1, np=2)
    err = info.value
    assert err.root_cause.rank == 1
    assert err.root_cause.summary == "ValueError: rank one cannot go on"
    assert "in _fail_on_rank_1" in err.root_cause.traceback
    assert 'raise ValueError("rank one cannot go on")' in err.root_cause.traceback
    assert err.root_cause.log_tail == ("rank 1 ready",)
    # One report, root cause first: rank, host, the user's file and line, the exception; no phalanx frame.
    line = _fail_on_rank_1.__code__.co_firstlineno + 7
    assert str(err).splitlines()[0] == (f"rank 1 [on host {socket.gethostname()}] failed at {__file__}:{line} in "
                                         "_fail_on_rank_1: ValueError: rank one cannot go on")
    assert "phalanx/" not in err.root_cause.traceback and str(err).count("Traceback") == 1
    assert [f.rank for f in err.failures] == [1, 0]
    assert len(traceback.extract_tb(err.__traceback__)) == 2  # this test's call, phalanx.run's re-raise


def _die(how: str) -> None:
    if os.environ["RANK"] == "0":
        if how == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        os._exit(7)
    time.sleep(60)  # under test: rank 1 still runs when rank 0 dies, and only the teardown ends it


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("how", "text", "code"), [("kill", "signal SIGKILL (9)", 137), ("exit", "exit code 7", 7)])
def test_death_by_signal_or_exit_code_is_reported(how: str, text: str, code: int) -> None:
    with pytest.raises(WorkerFailedError, match=f"rank 0 .* failed: process ended with {re.escape(text)}") as info:
        phalanx.run(_die, args=(how,), np=2)
    assert info.value.exit_code == code


def _spawn_daemon_then_fail(pidfile: str) -> None:
    import subprocess

    # A grandchild that leaves the worker's process group: teardown must still find it.
    p = subprocess.Popen(["sleep", "300"], start_new_session=True)
    Path(pidfile + os.environ["RANK"]).write_text(str(p.pid))
    if os.environ["RANK"] == "1":
        _wait_for_file(Path(pidfile + "0"))  # rank 0's grandchild runs too
        os.environ["PHALANX_RUN_ID"] = "cleared"  # the daemon keeps the marker it was started with
        raise RuntimeError("fail with a grandchild alive")
    time.sleep(60)  # under test: rank 0 is alive with its grandchild when rank 1 fails, and is torn down


@pytest.mark.timeout(60)
def test_whole_process_tree_is_torn_down(tmp_path: Path) -> None:
    with pytest.raises(WorkerFailedError, match="fail with a grandchild alive"):
        phalanx.run(_spawn_daemon_then_fail, args=(str(tmp_path / "pid"),), np=2)
    for rank in (0, 1):
        pid = int((tmp_path / f"pid{rank}").read_text())
        wait_gone(pid, WAIT_S, f"the grandchild of rank {rank}")


def _spawn_daemon_and_return(pidfile: str) -> int:
    import subprocess

    p = subprocess.Popen(["sleep", "300"], start_new_session=True)
    Path(pidfile + os.environ["RANK"]).write_text(str(p.pid))
    return p.pid


@pytest.mark.timeout(60)
def test_daemons_of_ranks_that_already_exited_are_swept(tmp_path: Path) -> None:
    # The ranks exit first, so their daemons are orphans (re-parented to init) when the job ends.
    pids = phalanx.run(_spawn_daemon_and_return, args=(str(tmp_path / "pid"),), np=2)
    for pid in pids:
        wait_gone(pid, WAIT_S, "the daemon of an exited rank")


@pytest.mark.timeout(60)
def test_start_timeout_names_missing_ranks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Rank 1's interpreter hangs at start-up (a sitecustomize runs before any phalanx code): the hang is under test.
    (tmp_path / "sitecustomize.py").write_text(
        "import os, time\nif os.environ.get('RANK') == '1':\n    time.sleep(60)\n")
    monkeypatch.setenv("PHALANX_WARM_START", "0")
    expected = r"rank\(s\) 1 of 2 did not start within 3 s; raise start_timeout="
    with pytest.raises(StartTimeoutError, match=expected):
        phalanx.run(os.getpid, np=2, start_timeout=3, env={"PYTHONPATH": str(tmp_path)})


def test_bad_input_fails_before_any_process_starts() -> None:
    lock = threading.Lock()
    with pytest.raises(PayloadError, match="closure variable 'lock'"):
        phalanx.run(lambda: lock.locked(), np=2)
    with pytest.raises(InvalidArgumentError, match="np must be a positive int"):
        phalanx.run(print, np=0)
    for slots in (0, True, 1.5):
        with pytest.raises(InvalidArgumentError, match=r"slots_per_host=.*: give the ranks one host may run"):
            phalanx.run(print, np=2, hosts="localhost", slots_per_host=slots)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgumentError, match="np=3 is more than the 2 slot"):  # a bare host: slots_per_host
        phalanx.run(print, np=3, hosts="localhost", slots_per_host=2)


def _unpicklable_result() -> Any:
    return threading.Lock()


@pytest.mark.timeout(60)
def test_unpicklable_return_value_is_reported() -> None:
    with pytest.raises(WorkerFailedError, match="return value of type lock cannot be pickled"):
        phalanx.run(_unpicklable_result, np=1)


def _killed_with_a_grandchild_holding_its_output(pidfile: str) -> None:
    """Rank 1 dies by SIGKILL while a grandchild keeps its stdout open (so its exit reaches the driver only
    after the drain wait); rank 0 then fails because its peer is gone."""
    import subprocess

    if os.environ["RANK"] == "1":
        subprocess.Popen(["sleep", "60"])  # inherits stdout and stderr
        Path(pidfile + ".tmp").write_text(str(os.getpid()))
        os.rename(pidfile + ".tmp", pidfile)  # whole, or not there
        os.kill(os.getpid(), signal.SIGKILL)
    _wait_for_file(Path(pidfile))
    peer = int(Path(pidfile).read_text())
    deadline = time.monotonic() + WAIT_S
    while _running(peer):  # dead (its channel closed), though its exit reaches the driver only after the drain
        if time.monotonic() > deadline:
            raise TimeoutError(f"rank 1 (pid {peer}) still runs {WAIT_S:g} s after its SIGKILL")
        time.sleep(0.01)
    # Under test: a survivor notices a lost peer only once the kernel has closed the dead rank's sockets, and
    # that comes after its main thread shows as a zombie (a killed process's files are closed as its last
    # thread exits, and the closes may run in any order); this margin stands for that delay. The driver
    # must still date rank 1's death first, though its exit is posted only after the drain wait.
    time.sleep(0.5)
    raise ConnectionError("peer rank 1 is gone")


@pytest.mark.timeout(90)
def test_the_rank_that_died_first_is_the_root_cause(tmp_path: Path) -> None:
    with pytest.raises(WorkerFailedError) as info:
        phalanx.run(_killed_with_a_grandchild_holding_its_output, args=(str(tmp_path / "pid"),), np=2)
    failures = info.value.failures
    assert [f.rank for f in failures] == [1, 0]
    assert "SIGKILL" in failures[0].summary and not failures[0].secondary
    assert failures[1].summary == "ConnectionError: peer rank 1 is gone"


def _running(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False
