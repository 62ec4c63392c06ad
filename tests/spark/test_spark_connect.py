"""phalanx.spark on a Spark Connect session (``SparkSession.builder.remote("local[2]")``).

The same promises as the classic tier (results, contract, logs, failures and teardown, scripts, slots,
driver-local modules), plus the Connect-only one: with the client unreachable from the executors, the
job still ends with its result or error and every rank's log.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from phalanx.env import names as env_names
from phalanx.errors import InvalidArgumentError, SlotsUnavailableError, WorkerFailedError
from phalanx.launch.proctree import is_alive
from phalanx.spark import HorovodRunner, TorchDistributor, log_to_driver, run

pytestmark = [pytest.mark.spark, pytest.mark.usefixtures("connect_spark")]

#: An address that does not route from the executors (TEST-NET-2, RFC 5737).
UNREACHABLE = "198.51.100.1"


def _contract(tag: str) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    t = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(t)
    dist.destroy_process_group()
    keys = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "HOROVOD_CROSS_SIZE", "USER_VAR")
    return {"tag": tag, "sum": t.item(), "python": sys.executable, **{k: os.environ.get(k) for k in keys}}


def _rank_value() -> int:
    rank = int(os.environ["RANK"])
    if rank == 0:
        time.sleep(1.0)  # rank 0 finishes last: its value must still be the one returned
    return rank * 10


@pytest.mark.timeout(300)  # the module's Connect server starts in this test's setup
def test_run_runner_and_distributor_return_what_a_classic_session_returns() -> None:
    out = run(_contract, args=("x",), num_proc=2, env={"USER_VAR": "u"})
    assert [o["RANK"] for o in out] == ["0", "1"]
    assert {o["sum"] for o in out} == {3.0}  # real allreduce, rendezvous through rank 0's task's store
    assert [(o["LOCAL_RANK"], o["HOROVOD_CROSS_SIZE"]) for o in out] == [("0", "1"), ("1", "1")]
    assert {o["tag"] for o in out} == {"x"} and {o["USER_VAR"] for o in out} == {"u"}
    assert HorovodRunner(np=2).run(_rank_value) == 0
    assert TorchDistributor(num_processes=2, local_mode=False, use_gpu=False).run(_rank_value) == 0


def _chatty(tag: str) -> str:
    print(f"plain output {tag} from rank {os.environ['RANK']}", flush=True)
    log_to_driver(f"callback {tag} from rank {os.environ['RANK']}")
    return tag


@pytest.mark.timeout(180)
def test_logs_stream_live_when_the_client_is_reachable(capsys: pytest.CaptureFixture[str],
                                                       caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="phalanx")
    assert HorovodRunner(np=2).run(_chatty, tag="cb") == "cb"
    out = capsys.readouterr().out
    assert "[0]<stdout>:callback cb from rank 0" in out and "[1]<stdout>:callback cb from rank 1" in out
    assert "plain output" not in out  # log_callback_only: the full output is in the files
    assert "logs stream live: rank 0's task reached this client" in caplog.text
    HorovodRunner(np=2, driver_log_verbosity="all").run(_chatty, tag="all")
    out = capsys.readouterr().out
    for rank in (0, 1):
        assert f"[{rank}]<stdout>:plain output all from rank {rank}" in out
        assert f"[{rank}]<stdout>:callback all from rank {rank}" in out


def _fail_after_output(marker: str) -> None:
    print(f"rank {os.environ['RANK']} was here", flush=True)
    if os.environ["RANK"] == "1":
        deadline = time.monotonic() + 60  # fail once rank 0 has written its line
        while not Path(marker).exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        raise ValueError("bad learning rate 42")
    Path(marker).write_text("")
    time.sleep(120)  # rank 0 would hang: phalanx must tear it down


@pytest.mark.timeout(180)
def test_unreachable_client_still_gets_the_result_the_error_and_the_logs(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
        caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setenv(env_names.PHALANX_CONNECT_CLIENT_HOST, UNREACHABLE)
    caplog.set_level(logging.INFO, logger="phalanx")
    assert HorovodRunner(np=2, driver_log_verbosity="all").run(_chatty, tag="late") == "late"
    out = capsys.readouterr().out
    for rank in (0, 1):
        assert f"[{rank}]<stdout>:plain output late from rank {rank}" in out
        assert f"[{rank}]<stdout>:callback late from rank {rank}" in out
    assert "logs returned with the result" in caplog.text and UNREACHABLE in caplog.text
    assert "logs stream live:" not in caplog.text
    with pytest.raises(WorkerFailedError) as info:
        run(_fail_after_output, args=(str(tmp_path / "rank0-wrote"),), num_proc=2)
    root = info.value.root_cause
    assert root.rank == 1 and "ValueError: bad learning rate 42" in root.summary
    assert 'raise ValueError("bad learning rate 42")' in root.traceback
    assert "rank 1 was here" in "\n".join(root.log_tail)
    assert "[0]<stdout>:rank 0 was here" in capsys.readouterr().out


def _fail_once_per_attempt(marker: str) -> None:
    rank = int(os.environ["RANK"])
    Path(f"{marker}.{rank}.{os.getpid()}").write_text(str(os.getpid()))
    if rank == 1:
        deadline = time.monotonic() + 60  # fail once rank 0 runs too (it may start later)
        while not list(Path(marker).parent.glob("attempt.0.*")) and time.monotonic() < deadline:
            time.sleep(0.05)
        raise ValueError("bad learning rate 42")
    time.sleep(120)


@pytest.mark.timeout(180)
def test_failure_reports_root_cause_once_and_tears_every_rank_down(tmp_path: Path) -> None:
    marker = str(tmp_path / "attempt")
    with pytest.raises(WorkerFailedError) as info:
        HorovodRunner(np=2).run(_fail_once_per_attempt, marker=marker)
    err = info.value
    assert err.root_cause.rank == 1 and "ValueError: bad learning rate 42" in err.root_cause.summary
    assert "Full output of every rank" in "".join(getattr(err, "__notes__", []))
    attempts = sorted(p.name.split(".")[1] for p in tmp_path.glob("attempt.*"))
    assert attempts == ["0", "1"], "a deterministic error must run once, not be retried by Spark"
    pids = [int(p.read_text()) for p in tmp_path.glob("attempt.*")]
    deadline = time.monotonic() + 15
    while any(is_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(is_alive(p) for p in pids)


@pytest.mark.timeout(180)
def test_script_returns_rank_0s_stdout_and_a_failing_rank_raises_its_exit_code(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text("import os, sys\nprint('rank', os.environ['RANK'], 'args', sys.argv[1:])\n"
                      "sys.exit(int(sys.argv[2]) if os.environ['RANK'] == '1' else 0)\n")
    dist = TorchDistributor(num_processes=2, local_mode=False, use_gpu=False)
    assert dist.run(str(script), "--code", "0") == "rank 0 args ['--code', '0']\n"
    with pytest.raises(WorkerFailedError) as info:
        dist.run(str(script), "--code", "3")
    assert info.value.root_cause.rank == 1 and info.value.exit_code == 3


@pytest.mark.timeout(60)
def test_slot_shortage_and_missing_gpus_fail_before_any_job() -> None:
    with pytest.raises(SlotsUnavailableError) as info:
        run(lambda: None, num_proc=3)
    assert "3 ranks were asked for" in str(info.value) and "only 2 task(s)" in str(info.value)
    assert "local[2]" in str(info.value)
    with pytest.raises(InvalidArgumentError, match=r"spark.task.resource.gpu.amount"):
        TorchDistributor(num_processes=2, local_mode=False, use_gpu=True).run(lambda: None)
    assert run(lambda: int(os.environ["WORLD_SIZE"])) == [2, 2]  # num_proc=None: every slot (local[2])


@pytest.mark.timeout(180)
def test_modules_next_to_the_driver_script_travel_with_the_job(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    project = tmp_path / "project"
    project.mkdir()
    (project / "connect_helper_mod.py").write_text("def scale(x):\n    return x * 3\n")
    from phalanx.job import shipping

    monkeypatch.setattr(shipping, "driver_root", lambda: project)  # as if the driver's script were there
    assert HorovodRunner(np=2).run(_uses_helper, value=7) == {"value": 21, "shipped": True}


def _uses_helper(value: int) -> dict[str, Any]:
    import connect_helper_mod  # only in the driver's project directory, on no executor path

    return {"value": connect_helper_mod.scale(value),
            "shipped": "project" not in os.path.dirname(connect_helper_mod.__file__)}


@pytest.mark.timeout(180)
def test_elastic_worker_killed_is_replaced_and_the_survivor_keeps_its_work(tmp_path: Path) -> None:
    from phalanx.spark import run_elastic

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "multiprocess" / "elastic"))
    import _digits_job as job

    steps, commit_every, kill_at = 20, 5, 12
    kwargs: dict[str, Any] = {"steps": steps, "commit_every": commit_every, "kill_at": kill_at, "victim": 1,
                              "marker": str(tmp_path / "killed")}
    out = run_elastic(job.train, (job.load_data(),), kwargs, num_proc=2, reset_limit=1,
                      env={env_names.PHALANX_ELASTIC_TIMEOUT_S: "30"})
    assert (tmp_path / "killed").exists(), "the victim never died"
    assert [r["rank"] for r in out] == [0, 1] and all(r["size"] == 2 for r in out)
    survivor = next(r for r in out if r["resumed_from"] == 0)
    replacement = next(r for r in out if r is not survivor)
    assert replacement["resumed_from"] == 10  # the last commit before step 12, from rank 0 via sync()


@pytest.mark.timeout(240)
def test_connect_digits_example_reaches_its_accuracy(tmp_path: Path) -> None:
    examples = Path(__file__).resolve().parents[2] / "examples"
    sys.path.insert(0, str(examples))
    import spark_connect_digits

    result = spark_connect_digits.main(["--np", "2", "--epochs", "3", "--out", str(tmp_path / "model.pt")])
    assert result["size"] == 2 and result["accuracy"] > 0.8
