"""phalanx.spark on a Spark Connect session (``SparkSession.builder.remote("local[2]")``).

The same promises as the classic tier (results, contract, logs, failures and teardown, scripts, slots,
driver-local modules), plus the Connect-only one: with the client unreachable from the executors, the
job still ends with its result or error and every rank's log.
"""

from __future__ import annotations

import logging
import os
import re
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from tests.waits import end_rank_0_last, wait_until

from phalanx.env import names as env_names
from phalanx.errors import InvalidArgumentError, SlotsUnavailableError, WorkerFailedError
from phalanx.launch.proctree import is_alive
from phalanx.spark import HorovodRunner, TorchDistributor, log_to_driver, run

pytestmark = [pytest.mark.spark, pytest.mark.usefixtures("connect_spark")]
WAIT_S = 60.0  # bounds waits that end much sooner (generous: a loaded host); a failure names it

#: An address that does not route from the executors (TEST-NET-2, RFC 5737).
UNREACHABLE = "198.51.100.1"


def _contract(tag: str) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    print(f"plain output {tag} from rank {os.environ['RANK']}", flush=True)
    dist.init_process_group("gloo")
    t = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(t)
    dist.destroy_process_group()
    keys = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "HOROVOD_CROSS_SIZE", "USER_VAR")
    return {"tag": tag, "sum": t.item(), "python": sys.executable, **{k: os.environ.get(k) for k in keys}}


@pytest.mark.timeout(600)  # the module's Connect server and its first python workers start here
def test_run_returns_every_rank_on_every_slot_and_streams_its_logs_live(
        capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="phalanx")
    out = run(_contract, args=("x",), env={"USER_VAR": "u"})  # num_proc=None: every slot of local[2]
    assert [o["RANK"] for o in out] == ["0", "1"] and {o["WORLD_SIZE"] for o in out} == {"2"}
    assert {o["sum"] for o in out} == {3.0}  # real allreduce, rendezvous through rank 0's task's store
    assert [(o["LOCAL_RANK"], o["HOROVOD_CROSS_SIZE"]) for o in out] == [("0", "1"), ("1", "1")]
    assert {o["tag"] for o in out} == {"x"} and {o["USER_VAR"] for o in out} == {"u"}
    printed = capsys.readouterr().out
    assert "[0]<stdout>:plain output x from rank 0" in printed and "[1]<stdout>:plain output x from rank 1" in printed
    assert "logs stream live: rank 0's task reached this client" in caplog.text


def _rank_work(value: int, folder: str) -> dict[str, Any]:
    import connect_helper_mod  # only in the driver's project directory, on no executor path

    rank = int(os.environ["RANK"])
    print(f"plain output from rank {rank}", flush=True)
    log_to_driver(f"callback from rank {rank}")
    end_rank_0_last(folder)  # rank 0 finishes last: its value must still be the one returned
    return {"rank": rank, "value": connect_helper_mod.scale(value),
            "shipped": "project" not in os.path.dirname(connect_helper_mod.__file__)}


@pytest.mark.timeout(180)
def test_horovod_runner_returns_rank_0s_value_shows_callback_lines_and_ships_modules(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    project = tmp_path / "project"
    project.mkdir()
    (project / "connect_helper_mod.py").write_text("def scale(x):\n    return x * 3\n")
    from phalanx.job import shipping

    monkeypatch.setattr(shipping, "driver_root", lambda: project)  # as if the driver's script were there
    assert HorovodRunner(np=2).run(_rank_work, value=7, folder=str(tmp_path)) == {"rank": 0, "value": 21,
                                                                                  "shipped": True}
    printed = capsys.readouterr().out
    assert "[0]<stdout>:callback from rank 0" in printed and "[1]<stdout>:callback from rank 1" in printed
    assert "plain output" not in printed  # log_callback_only: the full output is in the files


def _chatty(tag: str, folder: str) -> str:
    print(f"plain output {tag} from rank {os.environ['RANK']}", flush=True)
    log_to_driver(f"callback {tag} from rank {os.environ['RANK']}")
    end_rank_0_last(folder)  # rank 0 finishes last: its value must still be the one returned
    return f"{tag}-{os.environ['RANK']}"


def _fail_once_per_attempt(marker: str) -> None:
    rank = int(os.environ["RANK"])
    print(f"rank {rank} was here", flush=True)
    Path(f"{marker}.{rank}.{os.getpid()}").write_text(str(os.getpid()))
    if rank == 1:
        deadline = time.monotonic() + WAIT_S  # fail once rank 0 runs too (it may start later)
        while not list(Path(marker).parent.glob("attempt.0.*")):
            if time.monotonic() > deadline:
                raise TimeoutError(f"rank 0 did not start within {WAIT_S:g} s")
            time.sleep(0.05)
        raise ValueError("bad learning rate 42")
    time.sleep(120)  # rank 0 would hang: phalanx must tear it down


@pytest.mark.timeout(240)
def test_unreachable_client_still_gets_the_result_the_error_and_every_log(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
        caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setenv(env_names.PHALANX_CONNECT_CLIENT_HOST, UNREACHABLE)
    caplog.set_level(logging.INFO, logger="phalanx")
    (tmp_path / "late").mkdir()
    distributor = TorchDistributor(num_processes=2, local_mode=False, use_gpu=False)
    assert distributor.run(_chatty, "late", str(tmp_path / "late")) == "late-0"
    printed = capsys.readouterr().out
    for rank in (0, 1):
        assert f"[{rank}]<stdout>:plain output late from rank {rank}" in printed
        assert f"[{rank}]<stdout>:callback late from rank {rank}" in printed
    assert "logs returned with the result" in caplog.text and UNREACHABLE in caplog.text
    assert "logs stream live:" not in caplog.text

    marker = str(tmp_path / "attempt")
    with pytest.raises(WorkerFailedError) as info:
        HorovodRunner(np=2).run(_fail_once_per_attempt, marker=marker)
    root = info.value.root_cause
    assert root.rank == 1 and "ValueError: bad learning rate 42" in root.summary
    assert 'raise ValueError("bad learning rate 42")' in root.traceback
    assert "rank 1 was here" in "\n".join(root.log_tail)
    notes = "".join(getattr(info.value, "__notes__", []))
    assert "Full output of every rank" in notes
    found = re.search(r"Full output of every rank: (\S+)/rank\.N/", notes)
    assert found is not None, notes
    assert "rank 0 was here" in (Path(found.group(1)) / "rank.0" / "stdout").read_text()  # returned at the end
    attempts = sorted(p.name.split(".")[1] for p in tmp_path.glob("attempt.*"))
    assert attempts == ["0", "1"], "a deterministic error must run once, not be retried by Spark"
    pids = [int(p.read_text()) for p in tmp_path.glob("attempt.*")]
    wait_until(lambda: not any(is_alive(p) for p in pids), WAIT_S, "every rank ended after the failure")


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


@pytest.mark.timeout(180)
def test_slot_shortage_is_an_error_before_the_job_or_when_its_stage_cannot_start(
        connect_spark: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    from phalanx.spark.connect import session as connect_session

    with pytest.raises(SlotsUnavailableError) as info:
        run(lambda: None, num_proc=3)
    assert "3 ranks were asked for" in str(info.value) and "only 2 task(s)" in str(info.value)
    assert "local[2]" in str(info.value)
    with pytest.raises(InvalidArgumentError, match=r"spark.task.resource.gpu.amount"):
        TorchDistributor(num_processes=2, local_mode=False, use_gpu=True).run(lambda: None)
    settings = connect_session.conf  # local[*]: the server's host is asked for its cores (this host here)
    monkeypatch.setattr(connect_session, "conf", lambda s, k: "local[*]" if k == "spark.master" else settings(s, k))
    assert connect_session.task_slots(connect_spark) == len(os.sched_getaffinity(0))
    # Settings that do not give the slots (a cluster without spark.executor.instances): Spark would retry its
    # barrier check for 10 minutes; the client's start watch gives up after start_timeout.
    monkeypatch.setattr(connect_session, "task_slots", lambda session: None)
    with pytest.raises(SlotsUnavailableError, match=r"\(3 tasks\) did not start within 3 s.*raise start_timeout"):
        run(lambda: None, num_proc=3, start_timeout=3)


@pytest.mark.timeout(300)
def test_elastic_replaces_a_lost_worker_then_resubmits_a_failed_stage_from_its_checkpoint(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    from phalanx.spark import run_elastic

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "multiprocess" / "elastic"))
    import _digits_job as job

    caplog.set_level(logging.WARNING, logger="phalanx")
    # Rank 1's worker dies at step 8 (replaced in its slot), then its replacement kills its task at step 17
    # (as a lost executor would): Spark fails the stage, and the client submits it again.
    kwargs: dict[str, Any] = {"steps": 25, "commit_every": 5, "kill_at": 8, "victim": 1,
                              "marker": str(tmp_path / "killed"), "kill_task_at": 17}
    with pytest.raises(InvalidArgumentError, match="checkpoint_dir='ckpt' is relative"):
        run_elastic(job.train, (None,), kwargs, num_proc=2, checkpoint_dir="ckpt")
    # Cold starts: the worker's parent is then its task (a warm-started worker's is the template).
    out = run_elastic(job.train, (job.load_data(),), kwargs, num_proc=2, checkpoint_dir=str(tmp_path / "ckpt"),
                      reset_limit=2, env={env_names.PHALANX_ELASTIC_TIMEOUT_S: "30", env_names.PHALANX_WARM_START: "0"})
    assert (tmp_path / "killed").exists(), "the victim never died"
    # The task's killer started from the commit before step 8: the replacement, got from rank 0 via sync().
    assert (tmp_path / "killed.task").read_text() == "5"
    assert caplog.text.count("re-submitting from the last commit") == 1  # the lost worker failed no stage
    assert [r["rank"] for r in out] == [0, 1] and all(r["size"] == 2 for r in out)
    # The stage restarts from the last durable commit: 15 (the last before the task's kill at 17), or 20 or 25
    # when the survivor went on alone and committed before Spark failed the stage (on a loaded host it may
    # finish alone first: then the resubmitted stage has nothing left to run). Both ranks from the same one.
    resumed = {r["resumed_from"] for r in out}
    assert resumed in ({15}, {20}, {25}), out
    assert [r["executed"] for r in out] == [25 - resumed.pop()] * 2, out


@pytest.mark.timeout(240)
def test_connect_digits_example_reaches_its_accuracy(tmp_path: Path) -> None:
    examples = Path(__file__).resolve().parents[2] / "examples"
    sys.path.insert(0, str(examples))
    import spark_connect_digits

    result = spark_connect_digits.main(["--np", "2", "--epochs", "3", "--out", str(tmp_path / "model.pt")])
    assert result["size"] == 2 and result["accuracy"] > 0.8


def _deepspeed_flags() -> dict[str, Any]:
    import json

    argv = sys.argv[1:]
    with open(argv[argv.index("--deepspeed_config") + 1], encoding="utf-8") as f:
        config = json.load(f)
    return {"argv": argv[:2], "config": config, "rank": os.environ["RANK"], "world": os.environ["WORLD_SIZE"]}


@pytest.mark.timeout(120)
def test_deepspeed_distributor_gives_every_rank_pyspark_s_flags_and_the_config() -> None:
    from phalanx.spark import DeepspeedTorchDistributor

    config = {"zero_optimization": {"stage": 3}}
    out = DeepspeedTorchDistributor(numGpus=1, nnodes=2, localMode=False, useGpu=False,
                                    deepspeedConfig=config).run(_deepspeed_flags)
    assert out == {"argv": ["--deepspeed", "--deepspeed_config"], "config": config, "rank": "0", "world": "2"}
