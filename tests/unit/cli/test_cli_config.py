from __future__ import annotations

from pathlib import Path

import pytest

from phalanx.cli.main import main, parse_config
from phalanx.errors import InvalidArgumentError
from phalanx.launch.api import resolve_start_timeout, validate_env, validate_hosts, validate_np


def test_parse_full_command_line(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text("")
    cfg = parse_config(["-np", "3", "-H", "localhost:3", "--start-timeout", "12", "--output-filename",
                        str(tmp_path), "--no-prefix", "--timeline-filename", "t.json",
                        "python", str(script), "--lr", "1"])
    assert cfg.np == 3 and cfg.command == ("python", str(script), "--lr", "1")
    assert cfg.start_timeout_s == 12 and not cfg.prefix and cfg.output_dir == str(tmp_path)
    assert cfg.job_env()["HOROVOD_TIMELINE"].endswith("t.json")


@pytest.mark.parametrize("hosts", [[], ["-H", "localhost:2"]])
def test_x_reaches_the_ranks_on_this_machine(hosts: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """``-x`` used to reach only ranks on other hosts (issue 32, item 3); mpirun and horovodrun export it
    everywhere. An explicit flag still wins over ``-x`` for the variable it sets."""
    monkeypatch.setenv("FROM_HERE", "here")
    cfg = parse_config(["-np", "2", *hosts, "-x", "NAME=VALUE", "-x", "FROM_HERE",
                        "-x", "HOROVOD_GLOO_TIMEOUT_SECONDS=9",
                        "--gloo-timeout-seconds", "2", "true"])
    env = cfg.to_spec().env
    assert env["NAME"] == "VALUE" and env["FROM_HERE"] == "here"
    assert env["HOROVOD_GLOO_TIMEOUT_SECONDS"] == "2"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["-np", "0", "true"], "-np must be a positive int"),
        (["-np", "2"], "no command given"),
        (["-np", "2", "no-such-binary-xyz"], "'no-such-binary-xyz' was not found"),
        (["-np", "2", "python", "missing_script.py"], "script 'missing_script.py' does not exist"),
        (["-np", "2", "-H", "otherhost.invalid:2", "true"], "host 'otherhost.invalid' does not resolve"),
        (["-np", "4", "-H", "localhost:2", "true"], r"np=4 is more than the 2 slot\(s\)"),
        (["-np", "2", "--start-timeout", "-1", "true"], "start_timeout must be a positive"),
    ],
)
def test_bad_input_is_refused_before_anything_starts(argv: list[str], message: str) -> None:
    with pytest.raises(InvalidArgumentError, match=message):
        parse_config(argv)


def test_main_reports_usage_errors_with_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["-np", "2", "python", "missing_script.py"]) == 2
    assert "does not exist" in capsys.readouterr().err


@pytest.mark.parametrize("np", [0, -1, 1.5, "2", True, None])
def test_validate_np_rejects(np: object) -> None:
    with pytest.raises(ValueError, match="np must be a positive int"):
        validate_np(np)


def test_start_timeout_resolution() -> None:
    assert resolve_start_timeout(None, {}) == 30.0
    assert resolve_start_timeout(None, {"HOROVOD_START_TIMEOUT": "7"}) == 7.0
    assert resolve_start_timeout(3, {"HOROVOD_START_TIMEOUT": "7"}) == 3.0
    with pytest.raises(InvalidArgumentError, match="number of seconds"):
        resolve_start_timeout(None, {"HOROVOD_START_TIMEOUT": "soon"})


def test_spark_start_timeout_resolution_follows_horovod_spark_run() -> None:
    """On Spark the time also covers scheduling the barrier tasks: ``horovod.spark.run``'s 600 s default and
    its ``HOROVOD_SPARK_START_TIMEOUT``; phalanx's documented ``HOROVOD_START_TIMEOUT`` still applies when set."""
    assert resolve_start_timeout(None, {}, spark=True) == 600.0
    assert resolve_start_timeout(None, {"HOROVOD_START_TIMEOUT": "7"}, spark=True) == 7.0
    both = {"HOROVOD_START_TIMEOUT": "7", "HOROVOD_SPARK_START_TIMEOUT": "90"}
    assert resolve_start_timeout(None, both, spark=True) == 90.0
    assert resolve_start_timeout(None, both) == 7.0  # not on Spark
    assert resolve_start_timeout(3, both, spark=True) == 3.0
    with pytest.raises(InvalidArgumentError, match="HOROVOD_SPARK_START_TIMEOUT"):
        resolve_start_timeout(None, {"HOROVOD_SPARK_START_TIMEOUT": "inf"}, spark=True)


def test_env_and_hosts_validation() -> None:
    assert validate_env({"A": "1"}) == {"A": "1"}
    with pytest.raises(InvalidArgumentError, match="not strings"):
        validate_env({"A": 1})  # type: ignore[dict-item]
    validate_hosts("localhost:2,127.0.0.1:1", 3)


def test_gloo_flag_is_accepted_as_horovodrun_does() -> None:
    assert parse_config(["-np", "2", "--gloo", "true"]).command == ("true",)
