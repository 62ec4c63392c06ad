"""phalanx.env.settings: one truth rule, one error type, every variable named once; no processes."""

from __future__ import annotations

import ast

import pytest
from _source_tree import parsed

from phalanx.env import names, settings
from phalanx.errors import InvalidArgumentError, SettingError

# white-box: stubs the transport's machine checks (x86-64, /dev/shm), which no public name switches
from phalanx.transport import _setup, api
from phalanx.worker import dist_backend

ONE_HOST = {"WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2", "GROUP_WORLD_SIZE": "1"}


@pytest.mark.parametrize("value", ["", "  "])
def test_an_empty_phalanx_shm_means_unset_for_every_reader(value: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The transport (hvd.init) and the torch-native backend choice read ``PHALANX_SHM=`` alike: as unset."""
    monkeypatch.setenv(names.PHALANX_SHM, value)
    monkeypatch.setattr(_setup._segment, "available", lambda: True)
    monkeypatch.setattr(_setup.platform, "machine", lambda: "x86_64")
    monkeypatch.setattr(dist_backend, "_x86_64", lambda: True)
    assert api.enabled() is True
    assert dist_backend.SHM_BACKEND in dist_backend.choose("gloo", {**ONE_HOST, names.PHALANX_SHM: value})


@pytest.mark.parametrize("value", ["0", "off", "FALSE", " no "])
def test_phalanx_shm_off_is_off_for_every_reader(value: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(names.PHALANX_SHM, value)
    monkeypatch.setattr(_setup._segment, "available", lambda: True)
    monkeypatch.setattr(dist_backend, "_x86_64", lambda: True)
    assert api.enabled() is False
    assert dist_backend.choose("gloo", {**ONE_HOST, names.PHALANX_SHM: value}) == "gloo"


def test_unset_and_empty_give_the_default_for_every_setting() -> None:
    for setting in (*settings.CONTRACT, *settings.LAUNCHER_SET, *settings.KNOBS):
        assert setting.get({}) == setting.default, setting.name
        assert setting.get({setting.name: " "}) == setting.default, setting.name


def test_a_bad_value_raises_one_error_type_naming_variable_value_and_fix() -> None:
    bad = {settings.SHM: "maybe", settings.SHM_TIMEOUT: "soon", settings.FUSION_THRESHOLD: "lots",
           settings.LOG_LEVEL: "LOUD", settings.GLOO_TIMEOUT: "0", settings.TEARDOWN_GRACE: "-1",
           settings.SHM_SLOT_BYTES: "-5", settings.ELASTIC_WORKER_ID: "x"}
    for setting, raw in bad.items():
        with pytest.raises(SettingError) as info:
            setting.get({setting.name: raw})
        message = str(info.value)
        assert f"{setting.name}={raw!r}" in message and "fix or unset it" in message, message
        assert isinstance(info.value, (InvalidArgumentError, ValueError))


def test_parsed_values() -> None:
    assert settings.SHM_TIMEOUT.get({names.PHALANX_SHM_TIMEOUT_S: " 2.5 "}) == 2.5
    assert settings.SHM_SLOT_BYTES.get({names.PHALANX_SHM_SLOT_BYTES: "2e6"}) == 2_000_000
    assert settings.LOG_LEVEL.get({names.HOROVOD_LOG_LEVEL: "debug"}) == "DEBUG"
    assert settings.WARM_START.get({names.PHALANX_WARM_START: "Off"}) is False
    assert settings.STALL_CHECK.get({names.PHALANX_STALL_CHECK_S: "0"}) == 0.0
    assert settings.ELASTIC_WORKER_ID.get({names.PHALANX_ELASTIC_WORKER_ID: "3"}) == 3


def test_every_phalanx_and_horovod_variable_has_one_setting() -> None:
    declared = {v for k, v in vars(names).items() if k.isupper() and v.startswith(("PHALANX_", "HOROVOD_"))}
    covered = [s.name for s in (*settings.CONTRACT, *settings.LAUNCHER_SET, *settings.KNOBS)]
    assert len(covered) == len(set(covered))
    # Horovod's rank names are the worker contract (phalanx.env.contract reads them).
    contract = {names.HOROVOD_RANK, names.HOROVOD_SIZE, names.HOROVOD_LOCAL_RANK, names.HOROVOD_LOCAL_SIZE,
                names.HOROVOD_CROSS_RANK, names.HOROVOD_CROSS_SIZE}
    assert declared - contract == set(covered) - {names.NCCL_IB_DISABLE}


def _reads_environ(node: ast.AST) -> bool:
    """``os.environ.get(names.X...)``, ``env.get(names.X)`` or ``environ[names.X]`` with a PHALANX_ name."""
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in ("get", "pop"):
        args = node.args[:1]
    elif isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load):
        args = [node.slice]
    else:
        return False
    return any(isinstance(a, ast.Attribute) and a.attr.startswith(("PHALANX_", "HOROVOD_")) for a in args)


def test_no_module_outside_env_parses_a_phalanx_or_horovod_variable() -> None:
    found = []
    for path, tree in parsed():
        if path.parent.name == "env":
            continue
        found += [f"{path.name}:{n.lineno}" for n in ast.walk(tree) if _reads_environ(n)]
    assert not found, f"read through phalanx.env.settings instead: {found}"


def test_the_contract_rank_variables_follow_the_same_rule() -> None:
    env = {names.HOROVOD_RANK: " ", names.RANK: "3"}
    assert settings.first_int(env, names.HOROVOD_RANK, names.RANK, default=0) == 3
    assert settings.first_int({}, names.HOROVOD_RANK, names.RANK, default=7) == 7
    with pytest.raises(SettingError, match="RANK='x' is not an integer"):
        settings.first_int({names.RANK: "x"}, names.RANK, default=0)
