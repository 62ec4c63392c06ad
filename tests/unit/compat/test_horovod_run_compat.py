"""``horovod.run`` under the alias: Horovod 0.28.1's parameter names map onto phalanx.run (no processes)."""

from __future__ import annotations

import sys
import warnings
from pathlib import Path
from typing import Any

import pytest

from phalanx.compat import horovod_run
from phalanx.errors import InvalidArgumentError


def _train(x: int, scale: int = 1) -> int:
    return x * scale


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    seen: list[dict[str, Any]] = []

    def fake_run(fn: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None, np: int = 1,
                 **options: Any) -> list[Any]:
        seen.append({"fn": fn, "args": args, "kwargs": kwargs, "np": np, **options})
        return [fn(*args, **(kwargs or {}))] * np

    monkeypatch.setattr("phalanx.run", fake_run)
    return seen


def test_horovods_names_map_onto_phalanx_run(calls: list[dict[str, Any]]) -> None:
    out = horovod_run.run(_train, args=(3,), kwargs={"scale": 2}, num_proc=2, min_num_proc=1, max_num_proc=4,
                          reset_limit=3, hosts="localhost:4", start_timeout=40, output_filename="out",
                          verbose=True, use_gloo=True, executable=sys.executable)
    assert out == [6, 6]
    call = calls[0]
    assert (call["np"], call["min_np"], call["max_np"], call["reset_limit"]) == (2, 1, 4, 3)
    assert (call["hosts"], call["start_timeout"], call["output_filename"], call["verbose"]) == (
        "localhost:4", 40, "out", True)
    assert call["args"] == (3,) and call["kwargs"] == {"scale": 2}


def test_positional_call_as_in_horovod(calls: list[dict[str, Any]]) -> None:
    assert horovod_run.run(_train, (5,), None, 3) == [5, 5, 5]
    assert calls[0]["np"] == 3 and calls[0]["min_np"] is None and calls[0]["verbose"] is False


def test_deprecated_names_warn_as_in_horovod(calls: list[dict[str, Any]]) -> None:
    with pytest.warns(DeprecationWarning) as caught:
        horovod_run.run(_train, (1,), np=2, min_np=1, max_np=2)
    assert sorted(str(w.message) for w in caught) == [
        "max_np is deprecated, use max_num_proc instead", "min_np is deprecated, use min_num_proc instead",
        "np is deprecated, use num_proc instead"]
    assert (calls[0]["np"], calls[0]["min_np"], calls[0]["max_np"]) == (2, 1, 2)


@pytest.mark.parametrize(
    ("options", "named"),
    [
        ({"ssh_port": 22}, "ssh_port"),
        ({"ssh_identity_file": "id", "hosts": "localhost:2"}, "ssh_identity_file"),
        ({"network_interfaces": ["lo"]}, "network_interfaces"),
        ({"disable_cache": True}, "disable_cache"),
        ({"use_mpi": True}, "use_mpi"),
        ({"mpi_args": "--x"}, "mpi_args"),
        ({"cooldown_range": (1, 2)}, "cooldown_range"),
    ],
)
def test_noop_parameters_warn_naming_themselves(calls: list[dict[str, Any]], options: dict[str, Any],
                                                named: str) -> None:
    with pytest.warns(UserWarning, match=rf"horovod.run\({named}=...\) changes nothing: "):
        assert horovod_run.run(_train, (1,), num_proc=1, **options) == [1]
    assert named not in calls[0]


def test_unset_parameters_warn_nothing(calls: list[dict[str, Any]]) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        horovod_run.run(_train, (1,), num_proc=1, disable_cache=False, use_gloo=True)


@pytest.mark.parametrize(
    ("options", "error", "message"),
    [
        ({"hosts": "localhost:2", "hostfile": "h"}, ValueError, "hosts and hostfile only allow one provided"),
        ({"use_gloo": True, "use_mpi": True}, ValueError, "use_gloo and use_mpi only allow one set True"),
        ({"executable": "/usr/bin/python2"}, InvalidArgumentError, "executable='/usr/bin/python2'"),
        ({"slots": 0}, InvalidArgumentError, r"slots=0: give the ranks one host may run"),
    ],
)
def test_refused_before_anything_starts(calls: list[dict[str, Any]], options: dict[str, Any],
                                        error: type[Exception], message: str) -> None:
    with pytest.raises(error, match=message):
        horovod_run.run(_train, (1,), num_proc=2, **options)
    assert calls == []


def test_hostfile_becomes_hosts(calls: list[dict[str, Any]], tmp_path: Path) -> None:
    hostfile = tmp_path / "hosts.txt"
    hostfile.write_text("localhost slots=2\n")
    assert horovod_run.run(_train, (1,), num_proc=2, hostfile=str(hostfile)) == [1, 1]
    assert calls[0]["hosts"] == "localhost:2"


def test_slots_are_the_slots_of_hosts_listed_without_theirs(calls: list[dict[str, Any]], tmp_path: Path) -> None:
    hostfile = tmp_path / "hosts.txt"
    hostfile.write_text("localhost\n")  # no slots=: horovod.run(slots=3) gives it 3
    assert horovod_run.run(_train, (1,), num_proc=3, hostfile=str(hostfile), slots=3) == [1, 1, 1]
    assert calls[0]["hosts"] == "localhost:3" and calls[0]["slots_per_host"] == 3
    horovod_run.run(_train, (1,), num_proc=2, host_discovery_script="./discover.sh", slots=2)
    assert calls[1]["slots_per_host"] == 2  # the discovery script's bare host lines (Horovod's own rule)


@pytest.mark.parametrize("option", [{"ssh_port": 2222}, {"ssh_identity_file": "id"}, {"network_interfaces": ["eth1"]}])
def test_ssh_options_for_remote_hosts_are_refused(calls: list[dict[str, Any]], monkeypatch: pytest.MonkeyPatch,
                                                  option: dict[str, Any]) -> None:
    monkeypatch.setattr(horovod_run, "only_this_machine", lambda hosts: False)  # as if h1, h2 were other machines
    with pytest.raises(InvalidArgumentError, match=r"phalanx.run (has no ssh options|picks the route)"):
        horovod_run.run(_train, (1,), num_proc=2, hosts="h1:1,h2:1", **option)
    assert calls == []


def test_parameters_phalanx_run_takes_are_passed_through(calls: list[dict[str, Any]],
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    def run_with_ssh(fn: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None, np: int = 1, *,
                     ssh_port: int | None = None, **options: Any) -> list[Any]:
        calls.append({"ssh_port": ssh_port})
        return [fn(*args)]

    monkeypatch.setattr("phalanx.run", run_with_ssh)
    assert horovod_run.run(_train, (1,), num_proc=1, ssh_port=2222) == [1]
    assert calls == [{"ssh_port": 2222}]


def test_phalanx_runs_own_ssh_options_receive_horovods(monkeypatch: pytest.MonkeyPatch) -> None:
    import inspect

    import phalanx.launch.api as api

    accepted = inspect.signature(api.run).parameters
    assert {"ssh_port", "ssh_identity_file", "network_interfaces"} <= set(accepted)
    seen: dict[str, Any] = {}

    def spy(fn: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None, np: int = 1,
            **options: Any) -> list[Any]:
        seen.update(options)
        return [fn(*args)]

    spy.__signature__ = inspect.signature(api.run)  # type: ignore[attr-defined]
    monkeypatch.setattr("phalanx.run", spy)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        horovod_run.run(_train, (1,), num_proc=1, ssh_port=2222, ssh_identity_file="id",
                        network_interfaces=["eth1"])
    assert (seen["ssh_port"], seen["ssh_identity_file"], seen["network_interfaces"]) == (2222, "id", ["eth1"])


def test_horovod_common_util_env_sets_and_restores(monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    import horovod.common.util as util  # phalanx's alias (no real horovod here): what a user imports

    monkeypatch.setenv("PHALANX_TEST_KEPT", "before")
    monkeypatch.delenv("PHALANX_TEST_NEW", raising=False)
    with util.env(PHALANX_TEST_KEPT="inside", PHALANX_TEST_NEW="1", PHALANX_TEST_NONE=None):
        assert os.environ["PHALANX_TEST_KEPT"] == "inside" and os.environ["PHALANX_TEST_NEW"] == "1"
        assert "PHALANX_TEST_NONE" not in os.environ
    assert os.environ["PHALANX_TEST_KEPT"] == "before" and "PHALANX_TEST_NEW" not in os.environ
