"""The pure pieces of phalanx.spark, without a JVM: hosts, GPUs, slots, module shipping."""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path
from typing import Any

import pytest

from phalanx.env import JobContract
from phalanx.errors import InvalidArgumentError, PhalanxError, SlotsUnavailableError
from phalanx.job import shipping
from phalanx.job.payload import serialize_call
from phalanx.spark import session
from phalanx.spark.connect.session import check_slots
from phalanx.spark.gpus import check_gpu_conf, ranks_per_task

# white-box: _gpu_env: each rank's CUDA_VISIBLE_DEVICES, a task's internal step (no public name)
from phalanx.spark.task import TaskSpec, _gpu_env, check_script, rank_layout, task_gpus, task_host

JOB = JobContract(run_id="r", master_addr="h", master_port=1, channel="h:2", secret="00")


def test_task_host_prefers_the_names_spark_gave_the_executor() -> None:
    assert task_host({"SPARK_LOCAL_HOSTNAME": "node-a", "SPARK_LOCAL_IP": "10.0.0.1"}) == "node-a"
    assert task_host({"SPARK_LOCAL_IP": "10.0.0.1"}) == "10.0.0.1"
    assert task_host({}) != ""


class _Gpu:
    def __init__(self, addresses: list[str]) -> None:
        self.addresses = addresses


def test_gpu_env_makes_cuda_local_rank_the_tasks_own_gpu_or_gives_a_clear_error() -> None:
    spec = TaskSpec(job=JOB, use_gpu=True)
    hosts = ["a", "b", "a", "b"]
    gpus = [["2"], ["0"], ["3"], ["1"]]
    # rank 2 is local rank 1 on host a: device index 1 of "2,3" is its own GPU "3"
    assert _gpu_env(spec, hosts, gpus, 2) == {"CUDA_VISIBLE_DEVICES": "2,3"}
    assert _gpu_env(spec, hosts, gpus, 1) == {"CUDA_VISIBLE_DEVICES": "0,1"}
    assert _gpu_env(TaskSpec(job=JOB), hosts, [[], [], [], []], 0) == {}
    assert task_gpus({"gpu": _Gpu(["2", "3"])}) == ["2", "3"] and task_gpus({}) == []
    with pytest.raises(PhalanxError, match=r"rank 1 no GPU.*spark.task.resource.gpu.amount"):
        _gpu_env(spec, hosts, [["0"], [], ["1"], ["2"]], 1)


def test_k_gpus_per_task_pin_each_of_its_k_ranks_to_one_of_them_as_spark_assigned() -> None:
    """Two tasks of 4 GPUs on host a (addresses Spark gave, not 0..3) and one on host b: 12 ranks, rank
    ``4t+j`` on task t's j-th GPU; ``cuda:LOCAL_RANK`` is exactly the rank's own GPU on every rank."""
    spec = TaskSpec(job=JOB, use_gpu=True, ranks_per_task=4)
    hosts, gpus = rank_layout(["a", "b", "a"], [["1", "3", "4", "6"], ["0", "1", "2", "3"], ["0", "2", "5", "7"]], 4)
    assert hosts == ["a"] * 4 + ["b"] * 4 + ["a"] * 4
    from phalanx.env import assign_ranks

    who = assign_ranks(hosts)
    own = {}
    for rank in range(12):
        visible = _gpu_env(spec, hosts, gpus, rank)["CUDA_VISIBLE_DEVICES"].split(",")
        own[rank] = (hosts[rank], visible[who[rank].local_rank])
    assert [own[r][1] for r in range(12)] == ["1", "3", "4", "6", "0", "1", "2", "3", "0", "2", "5", "7"]
    assert len(set(own.values())) == 12  # no GPU of a host is shared
    assert [who[r].local_rank for r in (0, 3, 4, 8, 11)] == [0, 3, 0, 4, 7]
    assert [who[r].cross_rank for r in (0, 4, 8)] == [0, 1, 0]
    # one rank per task keeps every GPU of its task (a fractional or single-GPU task)
    assert rank_layout(["a"], [["2", "5"]], 1) == (["a"], [["2", "5"]])
    # a task that got fewer GPUs than ranks: the rank without one fails, naming the setting
    hosts, gpus = rank_layout(["a"], [["0"]], 2)
    with pytest.raises(PhalanxError, match=r"runs 2 ranks \(spark.task.resource.gpu.amount=2\)"):
        _gpu_env(TaskSpec(job=JOB, use_gpu=True, ranks_per_task=2), hosts, gpus, 1)


def test_gpu_addresses_index_the_executors_cuda_visible_devices_when_the_cluster_manager_set_it() -> None:
    assert task_gpus({"gpu": _Gpu(["0", "1"])}, {"CUDA_VISIBLE_DEVICES": "4,6"}) == ["4", "6"]
    assert task_gpus({"gpu": _Gpu(["1"])}, {"CUDA_VISIBLE_DEVICES": "GPU-aa, GPU-bb"}) == ["GPU-bb"]
    assert task_gpus({"gpu": _Gpu(["3"])}, {}) == ["3"]
    with pytest.raises(PhalanxError, match=r"\['2'\].*CUDA_VISIBLE_DEVICES='4,6'"):
        task_gpus({"gpu": _Gpu(["0", "2"])}, {"CUDA_VISIBLE_DEVICES": "4,6"})


def test_ranks_per_task_follow_the_task_gpu_amount_as_pyspark_does() -> None:
    four: Any = _FakeContext("spark://m:1", [1], {"spark.task.resource.gpu.amount": "4"})
    assert ranks_per_task(four, 8, True, "num_processes") == 4
    assert ranks_per_task(four, 8, False, "num_processes") == 1  # CPU training: one rank per task
    with pytest.raises(InvalidArgumentError, match=r"num_processes \(6\) must be a multiple of "
                                                   r"'spark.task.resource.gpu.amount' \(4\).*num_processes=4 or 8"):
        ranks_per_task(four, 6, True, "num_processes")
    for amount in ("1", "0.5", "nonsense"):
        sc: Any = _FakeContext("spark://m:1", [1], {"spark.task.resource.gpu.amount": amount})
        assert ranks_per_task(sc, 3, True, "np") == 1


@pytest.mark.timeout(30)
@pytest.mark.usefixtures("fake_slots")
def test_the_slot_check_counts_tasks_of_k_gpus() -> None:
    sc: Any = _FakeContext("spark://m:7077", [2], {"spark.task.resource.gpu.amount": "4"})
    assert session.wait_for_slots(sc, 8, timeout_s=0.3, knob="start_timeout=", ranks_per_task=4) == 2
    with pytest.raises(SlotsUnavailableError) as info:
        session.wait_for_slots(sc, 12, timeout_s=0.3, knob="start_timeout=", ranks_per_task=4)
    message = str(info.value)
    assert "12 ranks (3 tasks of 4 GPUs each) were asked for" in message and "only 2 task(s)" in message
    assert "to 8 or less" in message and "spark.task.resource.gpu.amount=4" in message


class _ConnectConf:
    def __init__(self, values: dict[str, str]) -> None:
        self.values = values

    def get(self, key: str, default: str | None = None) -> str | None:
        return self.values.get(key, default)


class _FakeConnect:
    def __init__(self, values: dict[str, str]) -> None:
        self.conf = _ConnectConf(values)


def test_connect_slot_check_counts_the_executors_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    from phalanx.spark.connect import session as connect_session

    monkeypatch.setattr(connect_session, "is_connect", lambda s: True)
    cluster = {"spark.master": "spark://m:7077", "spark.executor.instances": "2", "spark.executor.cores": "8",
               "spark.executor.resource.gpu.amount": "4", "spark.task.resource.gpu.amount": "2"}
    session_: Any = _FakeConnect(cluster)
    check_slots(session_, 8, 2)  # 2 executors x 4 GPUs / 2 per task = 4 tasks of 2 ranks
    with pytest.raises(SlotsUnavailableError, match=r"10 ranks \(5 tasks of 2 GPUs each\).*only 4 task"):
        check_slots(session_, 10, 2)


class _Conf:
    def __init__(self, values: dict[str, str]) -> None:
        self.values = values

    def get(self, key: str, default: str | None = None) -> str | None:
        return self.values.get(key, default)


class _FakeContext:
    """Just what phalanx.spark.session reads of a SparkContext."""

    def __init__(self, master: str, slots: list[int], conf: dict[str, str] | None = None) -> None:
        self.master = master
        self._slots = slots
        self._conf = _Conf(conf or {})

    def getConf(self) -> _Conf:
        return self._conf

    def next_slots(self) -> int:
        return self._slots.pop(0) if len(self._slots) > 1 else self._slots[0]


def test_the_driver_listens_where_spark_binds_it_never_on_every_interface() -> None:
    sc: Any = _FakeContext("spark://m:7077", [1], {"spark.driver.host": "10.1.2.3"})
    assert session.bind_address(sc) == "10.1.2.3"
    sc = _FakeContext("spark://m:7077", [1], {"spark.driver.host": "node-a", "spark.driver.bindAddress": "10.9.9.9"})
    assert session.bind_address(sc) == "10.9.9.9"
    assert session.bind_address(_FakeContext("local[2]", [1])) == "127.0.0.1"


@pytest.fixture
def fake_slots(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(session, "task_slots", lambda sc: sc.next_slots())


@pytest.mark.timeout(30)
@pytest.mark.usefixtures("fake_slots")
def test_wait_for_slots_waits_for_executors_with_a_status_line(caplog: pytest.LogCaptureFixture) -> None:
    sc: Any = _FakeContext("spark://m:7077", [2, 2, 4])
    with caplog.at_level(logging.WARNING, logger="phalanx.spark.session"):
        assert session.wait_for_slots(sc, 4, timeout_s=20, knob="start_timeout=") == 4
    assert "waiting for task slots: 4 ranks asked for, 2 slots available" in caplog.text


@pytest.mark.timeout(30)
@pytest.mark.usefixtures("fake_slots")
def test_wait_for_slots_gives_up_with_the_numbers_and_the_knobs() -> None:
    sc: Any = _FakeContext("spark://m:7077", [3], {"spark.task.cpus": "2"})
    with pytest.raises(SlotsUnavailableError) as info:
        session.wait_for_slots(sc, 8, timeout_s=0.3, knob="start_timeout=")
    message = str(info.value)
    assert "8 ranks were asked for" in message and "only 3 task(s)" in message
    assert "spark.task.cpus=2" in message and "start_timeout=" in message


@pytest.mark.timeout(30)
@pytest.mark.usefixtures("fake_slots")
def test_local_masters_fail_at_once() -> None:
    sc: Any = _FakeContext("local[2]", [2])
    with pytest.raises(SlotsUnavailableError, match="waited 0 s"):
        session.wait_for_slots(sc, 3, timeout_s=600, knob="start_timeout=")


def test_use_gpu_needs_task_gpus_in_the_conf() -> None:
    with pytest.raises(InvalidArgumentError, match="use_gpu=False"):
        check_gpu_conf(_FakeContext("spark://m:1", [1]), True)  # type: ignore[arg-type]
    check_gpu_conf(_FakeContext("spark://m:1", [1], {"spark.task.resource.gpu.amount": "1"}), True)  # type: ignore[arg-type]
    check_gpu_conf(_FakeContext("spark://m:1", [1]), False)  # type: ignore[arg-type]


def test_collect_modules_takes_the_scripts_neighbours_and_imported_packages(tmp_path: Path,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "helper.py").write_text("X = 1\n")
    (tmp_path / "driver.py").write_text("")
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "deep.py").write_text("Y = 2\n")
    (tmp_path / "pkg" / "unused.py").write_text("")
    fake_main = type(sys)("__main__")
    fake_main.__file__ = str(tmp_path / "driver.py")
    monkeypatch.setitem(sys.modules, "__main__", fake_main)
    for name, rel in (("pkg", "pkg/__init__.py"), ("pkg.deep", "pkg/deep.py")):
        module = type(sys)(name)
        module.__file__ = str(tmp_path / rel)
        monkeypatch.setitem(sys.modules, name, module)
    assert shipping.driver_root() == tmp_path.resolve()
    files = shipping.collect_modules(tmp_path.resolve())
    assert sorted(files) == ["helper.py", "pkg/__init__.py", "pkg/deep.py"]
    monkeypatch.setattr(shipping, "MAX_FILES", 2)
    assert shipping.collect_modules(tmp_path.resolve()) == {}


def test_collect_modules_judges_imported_files_by_where_their_links_lead(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    root, elsewhere = tmp_path / "job", tmp_path / "elsewhere"
    (root / "pkg").mkdir(parents=True)
    elsewhere.mkdir()
    (root / "pkg" / "inside.py").write_text("")
    (elsewhere / "outside.py").write_text("")
    (root / "linked_out.py").symlink_to(elsewhere / "outside.py")  # under root by name only
    (elsewhere / "linked_in.py").symlink_to(root / "pkg" / "inside.py")  # a file of root's, by its link
    (elsewhere / "via_dir").symlink_to(root / "pkg", target_is_directory=True)
    for name, file in (("m_out", root / "linked_out.py"), ("m_in", elsewhere / "linked_in.py"),
                       ("m_dir", elsewhere / "via_dir" / "inside.py"), ("m_far", elsewhere / "outside.py")):
        module = type(sys)(name)
        module.__file__ = str(file)
        monkeypatch.setitem(sys.modules, name, module)
    files = shipping._imported_under(root.resolve())
    assert files == {(root / "pkg" / "inside.py").resolve()}


def test_no_shipping_from_the_python_installation(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_main = type(sys)("__main__")
    fake_main.__file__ = str(Path(sys.prefix) / "bin" / "pytest")
    monkeypatch.setitem(sys.modules, "__main__", fake_main)
    assert shipping.driver_root() is None


def _use_shipped() -> int:
    import phalanx_shipped_probe  # type: ignore[import-not-found]

    return int(phalanx_shipped_probe.VALUE)


def test_run_with_modules_imports_shipped_sources_then_cleans_up(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.delitem(sys.modules, "phalanx_shipped_probe", raising=False)
    inner = serialize_call(_use_shipped, (), {}, sys_path=())
    assert shipping.run_with_modules({"phalanx_shipped_probe.py": b"VALUE = 41 + 1\n"}, inner) == 42
    shipped_dir = Path(sys.modules["phalanx_shipped_probe"].__file__ or "").parent
    assert not shipped_dir.exists()
    monkeypatch.delitem(sys.modules, "phalanx_shipped_probe", raising=False)


class _CancelRecorder:
    def __init__(self) -> None:
        import threading

        self.cancelled: list[str] = []
        self.event = threading.Event()

    def cancelJobGroup(self, group: str) -> None:
        self.cancelled.append(group)
        self.event.set()


@pytest.mark.timeout(30)
def test_a_stage_still_running_after_abort_and_grace_is_cancelled() -> None:
    import threading

    from phalanx.launch.core import JobSpec
    from phalanx.spark.launcher import SparkLauncher

    sc = _CancelRecorder()
    launcher = SparkLauncher(JobSpec(np=2, teardown_grace_s=0.1), sc)  # type: ignore[arg-type]
    stage = threading.Thread(target=sc.event.wait, args=(20,), daemon=True)  # a stage that only ends on cancel
    stage.start()
    launcher.stage._job_thread = stage
    launcher.stage.stop(0.1)
    launcher.stage.stop(0.1)  # idempotent
    assert sc.event.wait(20), "the job group was not cancelled"
    stage.join(5)
    assert sc.cancelled == [launcher.run_id]


def test_a_session_without_spark_context_is_refused_clearly() -> None:
    class _ConnectLike:
        @property
        def sparkContext(self) -> Any:
            raise NotImplementedError("[NOT_IMPLEMENTED] sparkContext() is not implemented.")

    with pytest.raises(InvalidArgumentError, match="classic SparkSession"):
        session._classic_context(_ConnectLike())


def test_a_script_missing_on_the_executor_is_named_with_the_host(tmp_path: Path) -> None:
    job = JobContract(run_id="r", master_addr="h", master_port=1, channel="h:1", secret="s")
    check_script(TaskSpec(job=job, command=None))
    script = tmp_path / "train.py"
    script.write_text("pass\n")
    check_script(TaskSpec(job=job, command=(str(script), "--lr", "1")))
    with pytest.raises(PhalanxError, match=r"'/nonexistent/train.py' does not exist on executor host .*same path"):
        check_script(TaskSpec(job=job, command=("/nonexistent/train.py",)))


def test_horovod_runner_and_run_keep_np_as_processes_on_a_cluster_of_k_gpu_tasks(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from phalanx.launch.core import JobSpec
    from phalanx.spark import api, runner
    from phalanx.spark.runner import HorovodRunner

    sc: Any = _FakeContext("spark://m:1", [3], {"spark.task.resource.gpu.amount": "2"})
    specs: list[JobSpec] = []

    class _Done:
        values = [None]

    def fake_launch(spec: JobSpec, *rest: Any) -> _Done:
        specs.append(spec)
        return _Done()

    for module in (runner, api):
        monkeypatch.setattr(module, "spark_target", lambda progress=True: sc)
    monkeypatch.setattr(session, "task_slots", lambda sc: sc.next_slots())
    monkeypatch.setattr(runner, "launch", fake_launch)
    monkeypatch.setattr(api, "launch_spark", fake_launch)
    HorovodRunner(np=4).run(len)
    api.run(len, num_proc=None)
    assert [(s.np, s.tasks, s.ranks_per_task, s.use_gpu) for s in specs] == [(4, 2, 2, True), (6, 3, 2, True)]
    with pytest.raises(InvalidArgumentError, match=r"np \(3\) must be a multiple"):
        HorovodRunner(np=3).run(len)


def test_a_connect_task_of_k_gpus_reports_a_status_row_per_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    from phalanx.launch.core import JobSpec
    from phalanx.spark.connect import task as connect_task

    spec: Any = connect_task.ConnectTaskSpec(job=JobSpec(np=4, ranks_per_task=2, use_gpu=True), run_id="r",
                                             elastic=None, client="", secret="00", probe_s=0.0)
    failed = [{"host": "a", "gpus": ["3", "5"], "job": {"failed": "no store"}}, {"host": "b", "gpus": ["3", "5"]}]
    rows = [json.loads(b) for b in connect_task._run_ranks(spec, 1, failed)]
    assert [(r["rank"], r["error"]) for r in rows] == [(2, "no store"), (3, "no store")]
    seen: list[tuple[int, list[str], list[list[str]], str]] = []

    def fake_supervise_task(task_spec: Any, task: int, hosts: list[str], gpus: list[list[str]],
                            problem: str = "") -> list[str]:
        seen.append((task, hosts, gpus, problem))
        return [json.dumps({"rank": r, "exit": 0, "reported": True, "error": ""}) for r in (2, 3)]

    monkeypatch.setattr(connect_task, "supervise_task", fake_supervise_task)
    hosted = {"channel": "h:1", "secret": "00", "addr": "h", "port": 2}
    gathered = [{"host": "a", "gpus": ["3", "5"], "job": hosted}, {"host": "b", "gpus": [], "problem": "bad"}]
    rows = [json.loads(b) for b in connect_task._run_ranks(spec, 1, gathered)]
    assert [r["rank"] for r in rows] == [2, 3]
    assert seen == [(1, ["a", "b"], [["3", "5"], []], "bad")]
