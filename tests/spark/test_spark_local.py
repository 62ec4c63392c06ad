"""phalanx.spark on a real ``local[2]`` Spark: results, contract, logs, failures, slots, GPUs."""

from __future__ import annotations

import io
import os
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import pytest
from tests.waits import end_rank_0_last, wait_until

from phalanx.errors import InvalidArgumentError, SlotsUnavailableError, SparkJobError, WorkerFailedError
from phalanx.launch import warm
from phalanx.launch.proctree import is_alive
from phalanx.spark import HorovodRunner, TorchDistributor, log_to_driver, run

pytestmark = [pytest.mark.spark, pytest.mark.usefixtures("local_spark")]
WAIT_S = 60.0  # bounds waits that end much sooner (generous: a loaded host); a failure names it

KEYS = ["RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "HOROVOD_RANK", "HOROVOD_SIZE",
        "HOROVOD_LOCAL_RANK", "HOROVOD_LOCAL_SIZE", "HOROVOD_CROSS_RANK", "HOROVOD_CROSS_SIZE", "MASTER_ADDR",
        "TORCHELASTIC_RUN_ID", "HOROVOD_TIMELINE", "USER_VAR", "CUDA_VISIBLE_DEVICES"]


def _contract(tag: str) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    backend = f"{dist.get_backend()} {dist.get_backend_config()}"
    t = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(t)
    dist.destroy_process_group()
    return {"tag": tag, "sum": t.item(), "python": sys.executable, "pid": os.getpid(), "backend": backend,
            "listening": _listening_on([int(os.environ["PHALANX_CHANNEL"].rsplit(":", 1)[1]),
                                        int(os.environ["MASTER_PORT"])]),
            **{k: os.environ.get(k) for k in KEYS}}


def _listening_on(ports: list[int]) -> list[str]:
    """The local addresses (hex, as in /proc/net/tcp) of the listening sockets on ``ports`` (the driver runs
    on this host in local mode)."""
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for row in f.readlines()[1:]:
                local, state = row.split()[1], row.split()[3]
                addr, port = local.rsplit(":", 1)
                if state == "0A" and int(port, 16) in ports:
                    found.append(addr)
    return found


@pytest.mark.timeout(120)
def test_run_returns_every_rank_in_order_with_the_contract() -> None:
    out = run(_contract, args=("x",), num_proc=2, env={"USER_VAR": "u", "HOROVOD_TIMELINE": "/tmp/tl.json"})
    assert [o["RANK"] for o in out] == ["0", "1"]
    assert {o["sum"] for o in out} == {3.0}  # real allreduce, rendezvous through the driver's store
    # one host: gloo requests get shared memory, posing as gloo
    assert {o["backend"] for o in out} == {"gloo cpu:phalanx_shm,cuda:gloo"}
    assert all(o["tag"] == "x" and o["WORLD_SIZE"] == "2" for o in out)
    # local[2]: one executor host, so local ranks 0 and 1 and a single cross rank.
    assert [(o["LOCAL_RANK"], o["LOCAL_WORLD_SIZE"], o["HOROVOD_CROSS_RANK"], o["HOROVOD_CROSS_SIZE"])
            for o in out] == [("0", "2", "0", "1"), ("1", "2", "0", "1")]
    assert {o["python"] for o in out} == {sys.executable}
    assert {o["USER_VAR"] for o in out} == {"u"} and {o["HOROVOD_TIMELINE"] for o in out} == {"/tmp/tl.json"}
    assert len({o["pid"] for o in out} | {os.getpid()}) == 3
    assert all(o["CUDA_VISIBLE_DEVICES"] is None for o in out)
    # The channel and the store listen on the driver's address only, not on every interface.
    assert len(out[0]["listening"]) == 2 and not {"00000000", "0" * 32} & set(out[0]["listening"])


def _rank_value(folder: str) -> int:
    end_rank_0_last(folder)  # rank 0 finishes last: pyspark's TorchDistributor would return rank 1's value
    return int(os.environ["RANK"]) * 10


@pytest.mark.timeout(120)
def test_horovod_runner_and_distributor_return_rank_0s_value(tmp_path: Path) -> None:
    (tmp_path / "hr").mkdir()
    (tmp_path / "td").mkdir()
    assert HorovodRunner(np=2).run(_rank_value, folder=str(tmp_path / "hr")) == 0
    assert TorchDistributor(num_processes=2, local_mode=False, use_gpu=False).run(_rank_value,
                                                                                  str(tmp_path / "td")) == 0


@pytest.mark.timeout(120)
def test_horovod_runner_negative_np_runs_on_the_driver_without_spark() -> None:
    def where() -> tuple[str | None, int]:
        return os.environ.get("HOROVOD_SIZE"), os.getppid()

    size, parent = HorovodRunner(np=-2).run(where)
    # the ranks are children of the driver, or of its warm-start template (phalanx.launch.warm)
    assert size == "2" and parent in {os.getpid()} | warm.template_pids()


@pytest.mark.timeout(120)
def test_horovod_runner_np_zero_uses_every_slot_with_a_deprecation_warning() -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        size = HorovodRunner(np=0).run(lambda: int(os.environ["WORLD_SIZE"]))
    assert size == 2
    assert run(lambda: 1) == [1, 1]  # run(num_proc=None): one rank per slot too, as horovod.spark.run
    assert any(issubclass(w.category, DeprecationWarning) and "np=0" in str(w.message) for w in caught)


def _chatty(tag: str) -> str:
    print(f"plain output {tag} from rank {os.environ['RANK']}", flush=True)
    log_to_driver(f"callback {tag} from rank {os.environ['RANK']}")
    return tag


@pytest.mark.timeout(120)
def test_log_callback_only_shows_only_log_to_driver(capsys: pytest.CaptureFixture[str],
                                                    caplog: pytest.LogCaptureFixture) -> None:
    assert HorovodRunner(np=2).run(_chatty, tag="cb") == "cb"
    out, err = capsys.readouterr()
    assert "[0]<stdout>:callback cb from rank 0" in out and "[1]<stdout>:callback cb from rank 1" in out
    assert "plain output" not in out
    # What the start waited for, in order (plain lines: stderr is not a terminal here).
    steps = [ln for ln in err.splitlines() if ln.startswith("phalanx: ")]
    assert steps == ["phalanx: waiting for 2 barrier task(s) of Spark to start the ranks",
                     "phalanx: barrier tasks started 2/2", "phalanx: ranks started 2/2"], err
    # HorovodRunner's default hides print(): the driver says where it went, and the files have it.
    said = [r.getMessage() for r in caplog.records if "driver_log_verbosity='all' shows them here" in r.getMessage()]
    assert len(said) == 1 and said[0].startswith("phalanx: driver_log_verbosity='log_callback_only'"), said
    log_dir = said[0].split("go to ")[1].split("/rank.N")[0]
    assert "plain output cb from rank 1" in (Path(log_dir) / "rank.1" / "stdout").read_text()


@pytest.mark.timeout(120)
def test_verbosity_all_streams_every_rank(capsys: pytest.CaptureFixture[str]) -> None:
    HorovodRunner(np=2, driver_log_verbosity="all").run(_chatty, tag="all")
    out = capsys.readouterr().out
    for rank in (0, 1):
        assert f"[{rank}]<stdout>:plain output all from rank {rank}" in out
        assert f"[{rank}]<stdout>:callback all from rank {rank}" in out


@pytest.mark.timeout(120)
def test_run_writes_rank_output_to_given_streams() -> None:
    out, err = io.StringIO(), io.StringIO()

    def both() -> None:
        print("to out", flush=True)
        print("to err", file=sys.stderr, flush=True)

    run(both, num_proc=2, stdout=out, stderr=err)
    assert "[0]<stdout>:to out" in out.getvalue() and "[1]<stdout>:to out" in out.getvalue()
    assert "[1]<stderr>:to err" in err.getvalue() and "to err" not in out.getvalue()


def _fail_once_per_attempt(marker: str) -> None:
    rank = int(os.environ["RANK"])
    Path(f"{marker}.{rank}.{os.getpid()}").write_text(str(os.getpid()))
    if rank == 1:
        deadline = time.monotonic() + WAIT_S  # fail once rank 0 runs too (it may start later)
        while not list(Path(marker).parent.glob("attempt.0.*")):
            if time.monotonic() > deadline:
                raise TimeoutError(f"rank 0 did not start within {WAIT_S:g} s")
            time.sleep(0.05)
        raise ValueError("bad learning rate 42")
    time.sleep(120)  # rank 0 would hang: phalanx must tear it down


@pytest.mark.timeout(120)
def test_failure_reports_root_cause_once_and_tears_every_rank_down(tmp_path: Path, local_spark: Any) -> None:
    marker = str(tmp_path / "attempt")
    with pytest.raises(WorkerFailedError) as info:
        HorovodRunner(np=2).run(_fail_once_per_attempt, marker=marker)
    err = info.value
    assert err.root_cause.rank == 1 and "ValueError: bad learning rate 42" in err.root_cause.summary
    assert 'raise ValueError("bad learning rate 42")' in err.root_cause.traceback
    assert "Full output of every rank" in "".join(getattr(err, "__notes__", []))
    attempts = sorted(p.name.split(".")[1] for p in tmp_path.glob("attempt.*"))
    assert attempts == ["0", "1"], "a deterministic error must run once, not be retried by Spark"
    pids = [int(p.read_text()) for p in tmp_path.glob("attempt.*")]
    wait_until(lambda: not any(is_alive(p) for p in pids), WAIT_S, "every rank ended after the failure")
    assert list(local_spark.sparkContext.statusTracker().getActiveJobsIds()) == []


@pytest.mark.timeout(120)
def test_spark_still_works_after_a_failure() -> None:
    with pytest.raises(WorkerFailedError):
        run(lambda: 1 / 0, num_proc=2)
    assert run(lambda: int(os.environ["RANK"]), num_proc=2) == [0, 1]


@pytest.mark.timeout(120)
def test_script_returns_rank_0s_stdout_and_a_failing_rank_raises_its_exit_code(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text("import os, sys\nprint('rank', os.environ['RANK'], 'args', sys.argv[1:])\n"
                      "sys.exit(int(sys.argv[2]) if os.environ['RANK'] == '1' else 0)\n")
    dist = TorchDistributor(num_processes=2, local_mode=False, use_gpu=False)
    assert dist.run(str(script), "--code", "0") == "rank 0 args ['--code', '0']\n"
    with pytest.raises(WorkerFailedError) as info:
        dist.run(str(script), "--code", "3")
    assert info.value.root_cause.rank == 1 and info.value.exit_code == 3
    assert "exit code 3" in str(info.value)


@pytest.mark.timeout(120)
def test_local_mode_runs_on_the_driver(tmp_path: Path) -> None:
    dist = TorchDistributor(num_processes=2, local_mode=True, use_gpu=False)
    assert dist.run(_rank_value, str(tmp_path)) == 0


@pytest.mark.timeout(60)
def test_slot_shortage_fails_at_once_with_the_numbers() -> None:
    started = time.monotonic()
    with pytest.raises(SlotsUnavailableError) as info:
        run(lambda: None, num_proc=3)
    message = str(info.value)
    assert "3 ranks were asked for" in message and "only 2 task(s)" in message and "local[2]" in message
    assert "spark.task.cpus=1" in message
    assert time.monotonic() - started < 30


@pytest.mark.timeout(60)
def test_use_gpu_without_gpus_is_a_clear_error() -> None:
    with pytest.raises(InvalidArgumentError, match=r"spark.task.resource.gpu.amount"):
        TorchDistributor(num_processes=2, local_mode=False, use_gpu=True).run(lambda: None)
    with pytest.raises(InvalidArgumentError, match=r"needs 2 GPUs on the driver; found 0"):
        TorchDistributor(num_processes=2, local_mode=True, use_gpu=True).run(lambda: None)


@pytest.mark.timeout(60)
def test_bad_arguments_are_refused_before_spark_runs() -> None:
    with pytest.raises(InvalidArgumentError):
        HorovodRunner(np=2, driver_log_verbosity="loud")
    with pytest.raises(InvalidArgumentError):
        TorchDistributor(num_processes=0)
    with pytest.raises(InvalidArgumentError, match="not a file"):
        TorchDistributor(num_processes=1, local_mode=False, use_gpu=False).run("/nonexistent/train.py")
    with pytest.raises(InvalidArgumentError, match="unexpected argument"):
        run(lambda: None, num_proc=1, bogus=1)


def _sleep_forever(pid_dir: str) -> None:
    Path(pid_dir, os.environ["RANK"] + ".part").write_text(str(os.getpid()))
    os.replace(Path(pid_dir, os.environ["RANK"] + ".part"), Path(pid_dir, os.environ["RANK"]))
    time.sleep(300)  # under test: the ranks run until the driver's Ctrl-C stops them


@pytest.mark.timeout(120)
def test_ctrl_c_on_the_driver_stops_every_rank(tmp_path: Path) -> None:
    import signal
    import threading

    pidfiles = [tmp_path / "0", tmp_path / "1"]
    late: list[str] = []

    def interrupt_when_running() -> None:  # the ranks started (or not, after WAIT_S): Ctrl-C either way
        try:
            wait_until(lambda: all(p.exists() for p in pidfiles), WAIT_S, "both ranks wrote their pids")
        except AssertionError as e:
            late.append(str(e))
        os.kill(os.getpid(), signal.SIGINT)

    interrupter = threading.Thread(target=interrupt_when_running, daemon=True)
    interrupter.start()
    with pytest.raises(KeyboardInterrupt):
        run(_sleep_forever, args=(str(tmp_path),), num_proc=2)
    interrupter.join(WAIT_S)
    assert not late, late
    pids = [int(p.read_text()) for p in pidfiles]
    wait_until(lambda: not any(is_alive(p) for p in pids), WAIT_S, "every rank ended after the Ctrl-C")
    assert run(lambda: 7, num_proc=2) == [7, 7]


def _kill_my_task() -> None:
    import signal

    if os.environ["RANK"] == "1":
        # The rank's parent is the Spark task (a cold start): kill it, as a lost executor would.
        os.kill(int(os.environ["PHALANX_PARENT_PID"]), signal.SIGKILL)
    time.sleep(120)  # under test: rank 0 runs until its peer's task loss stops the job


@pytest.mark.timeout(120)
def test_a_task_dying_under_spark_is_a_spark_job_error() -> None:
    with pytest.raises(SparkJobError, match=r"Spark failed the barrier stage .* before rank\(s\)"):
        run(_kill_my_task, num_proc=2, env={"PHALANX_WARM_START": "0"})
    assert run(lambda: 3, num_proc=2) == [3, 3]


def _leave_state_behind() -> dict[str, Any]:
    import json

    import torch

    json.PHALANX_LEAK = 1  # type: ignore[attr-defined]
    torch.PHALANX_LEAK = 1  # type: ignore[attr-defined]
    os.environ["PHALANX_LEAK"] = "1"
    return {"parent": _parent_cmd()}


def _parent_cmd() -> str:
    with open(f"/proc/{os.getppid()}/cmdline", "rb") as f:
        return f.read().replace(b"\0", b" ").decode()


def _look_for_state() -> dict[str, Any]:
    import json

    import torch

    return {"parent": _parent_cmd(), "leaks": [hasattr(json, "PHALANX_LEAK"), hasattr(torch, "PHALANX_LEAK"),
                                               "PHALANX_LEAK" in os.environ], "mine": os.environ.get("JOB_VAR"),
            "ppid": os.getppid(), "pid": os.getpid(), "draw": torch.rand(4).tolist()}


@pytest.mark.timeout(180)
def test_later_spark_jobs_fork_from_the_executors_template_without_seeing_earlier_jobs() -> None:
    run(_leave_state_behind, num_proc=2)  # a first job starts the executor's template (and waits for it)
    second = run(_look_for_state, num_proc=2, env={"JOB_VAR": "second"})
    assert all("phalanx.worker.template_shared" in o["parent"] for o in second), second
    assert [o["leaks"] for o in second] == [[False, False, False]] * 2
    assert {o["mine"] for o in second} == {"second"}
    # local[2] is one executor: both tasks' ranks fork from its one template (a template per task would be two
    # parents), and the next job's ranks from the same one (no import of torch again).
    third = run(_look_for_state, num_proc=2, env={"JOB_VAR": "third"})
    assert len({o["ppid"] for o in second + third}) == 1, (second, third)
    # ... yet each rank is a process of its own, with generators of its own
    assert len({o["pid"] for o in second + third}) == 4
    assert len({tuple(o["draw"]) for o in second + third}) == 4
    assert {o["mine"] for o in third} == {"third"}
