"""Elastic jobs across hosts and shipped modules, without processes: where workers go, which are retired
when a host leaves, and how an agent installs a script job's shipped modules."""

from __future__ import annotations

import base64
import os
import queue
from pathlib import Path
from typing import Any

import pytest

from phalanx.env import JobContract
from phalanx.errors import InvalidArgumentError
from phalanx.job.elastic_policy import ElasticPolicy, HostsUpdated
from phalanx.job.shipping import script_of, write_modules
from phalanx.launch import elastic_hosts
from phalanx.launch.core import JobSpec
from phalanx.launch.elastic_hosts import ElasticHostAgents
from phalanx.launch.elasticity import ElasticSpec
from phalanx.launch.host_agent import Agent, AgentPlan
from phalanx.launch.hosts import HostSlots
from phalanx.launch.remote import HostsSpec

JOB = JobContract(run_id="r", master_addr="127.0.0.1", master_port=1, channel="127.0.0.1:2", secret="s" * 64,
                  start_timeout_s=5.0)


def _plan(**kw: Any) -> AgentPlan:
    return AgentPlan(job=JOB, hosts=("a", "a"), ranks=(1,), command=("python", "train.py"), **kw)


def test_plan_round_trip_with_elastic_variables_and_modules() -> None:
    plan = _plan(over={"PHALANX_ELASTIC_WORKER_ID": "1"}, modules={"helper.py": "eD0x"})
    assert AgentPlan.decode(plan.encode()) == plan
    with pytest.raises(InvalidArgumentError, match="non-string"):
        AgentPlan.decode(plan.encode().replace(b'"eD0x"', b"7"))


def test_shipped_paths_never_leave_their_directory(tmp_path: Path) -> None:
    for bad in ("../evil.py", "/etc/evil.py", "pkg/../../evil.py"):
        with pytest.raises(ValueError, match="leaves the modules' directory"):
            write_modules({bad: b"x"}, str(tmp_path))
    write_modules({"pkg/mod.py": b"x = 1"}, str(tmp_path))
    assert (tmp_path / "pkg" / "mod.py").read_bytes() == b"x = 1"


def test_script_of_a_command() -> None:
    assert script_of(["python3", "train.py", "--epochs", "3"]) == "train.py"
    assert script_of(["./train.py"]) == "./train.py"
    assert script_of(["python", "-m", "pkg"]) is None and script_of(["bash", "x.sh"]) is None


def test_agent_runs_the_shipped_script_when_the_host_lacks_it(tmp_path: Path) -> None:
    modules = {name: base64.b64encode(b"x = 1").decode() for name in ("train.py", "helper.py")}
    agent = Agent(_plan(modules=modules, cwd=str(tmp_path)))
    try:
        assert agent.modules_dir is not None and os.path.isfile(os.path.join(agent.modules_dir, "helper.py"))
        assert agent._command == ("python", os.path.join(agent.modules_dir, "train.py"))
        assert agent._env(1)["PYTHONPATH"].split(os.pathsep)[0] == agent.modules_dir
    finally:
        agent.remove_modules()
    assert not os.path.exists(agent.modules_dir)
    (tmp_path / "train.py").write_text("x = 2")  # the host has the script: it runs its own
    assert Agent(_plan(modules={}, cwd=str(tmp_path)))._command == ("python", "train.py")


class _Channel:
    def __init__(self) -> None:
        self.events: queue.Queue[object] = queue.Queue()


def _launcher(retired: list[int]) -> ElasticHostAgents:
    # Two names of this machine, so nothing resolves or connects: placement and retirement only.
    hosts = HostsSpec(hosts=(HostSlots("localhost", 2), HostSlots("127.0.0.1", 1)))
    launcher = ElasticHostAgents(JobSpec(np=3, command=("true",)), ElasticSpec(ElasticPolicy(1, 3)), hosts, "r")
    launcher.host_of.extend(["localhost", "localhost", "127.0.0.1"])
    launcher._agent_of.update({w: w for w in range(3)})  # type: ignore[misc]
    launcher.agents.retire = retired.append  # type: ignore[assignment, method-assign]
    launcher._channel = _Channel()  # type: ignore[assignment]
    return launcher


def test_a_host_that_leaves_discovery_has_its_workers_retired() -> None:
    retired: list[int] = []
    launcher = _launcher(retired)
    assert launcher._initial == ["localhost", "localhost", "127.0.0.1"]
    launcher._on_hosts({"localhost": 2, "-bad": 4})
    assert retired == [2] and launcher._leaving == {2} and launcher.target == 2
    assert launcher._channel.events.get_nowait() == HostsUpdated(2)  # type: ignore[union-attr]
    assert launcher.free_slots([0, 1]) == 0 and launcher.free_slots([0]) == 1


def test_a_host_whose_ssh_fails_leaves_the_job() -> None:
    retired: list[int] = []
    launcher = _launcher(retired)
    launcher._host_lost("localhost")
    assert retired == [0, 1] and launcher._down == {"localhost"} and launcher.target == 1
    assert launcher._channel.events.get_nowait() == HostsUpdated(1)  # type: ignore[union-attr]
    assert launcher.free_slots([2]) == 0
    launcher._leaving.add(2)
    assert launcher._free_host() == "127.0.0.1"


def test_a_joining_host_is_checked_first_and_left_out_when_it_fails(monkeypatch: pytest.MonkeyPatch,
                                                                     caplog: pytest.LogCaptureFixture) -> None:
    launcher = _launcher([])
    checked: list[tuple[list[str], float]] = []

    def problems(hosts: list[str], ssh: object, python: str, timeout_s: float) -> dict[str, str]:
        checked.append((list(hosts), timeout_s))
        return {h: f"host {h!r}: ssh could not connect or log in (exit code 255):\n    ssh: no route to {h}"
                for h in hosts if h.startswith("bad")}

    monkeypatch.setattr(elastic_hosts, "host_problems", problems)
    listed = {"localhost": 2, "127.0.0.1": 1, "badhost.invalid": 4, "goodhost.invalid": 1}
    launcher._on_hosts(listed)
    # Only the hosts new to the job are checked (this machine's names never), with the start timeout.
    assert checked == [(["badhost.invalid", "goodhost.invalid"], launcher.spec.start_timeout_s)]
    assert launcher._down == {"badhost.invalid"} and launcher.target == 3
    assert launcher._usable() == {"localhost": 2, "127.0.0.1": 1, "goodhost.invalid": 1}
    assert [r.getMessage() for r in caplog.records if "left out" in r.getMessage()] == [
        "elastic job: left out a host that host discovery added: host 'badhost.invalid': ssh could not connect "
        "or log in (exit code 255): ssh: no route to badhost.invalid"]
    # Listed again: neither is checked again; the bad one stays out. A host that left and comes back is.
    launcher._on_hosts({**listed, "goodhost.invalid": 2})
    launcher._on_hosts({"localhost": 2, "127.0.0.1": 1, "badhost.invalid": 4})
    launcher._on_hosts(listed)
    timeout = launcher.spec.start_timeout_s
    assert checked[1:] == [([], timeout), ([], timeout), (["goodhost.invalid"], timeout)]
    assert launcher._down == {"badhost.invalid"}
