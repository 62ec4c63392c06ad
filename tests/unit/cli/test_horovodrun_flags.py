"""phalanxrun parses every horovodrun flag (Horovod 0.28.1); the ones phalanx can use take effect."""

from __future__ import annotations

import io
import re
import time
from pathlib import Path

import pytest

from phalanx import HOROVOD_API_VERSION, __version__
from phalanx.cli import build_info
from phalanx.cli.main import main, parse_config
from phalanx.errors import InvalidArgumentError
from phalanx.job.logs import ConsoleSink
from phalanx.job.records import LogLine, Stream

# horovodrun's 61 arguments (its `horovodrun --help`), each with a value where it takes one. -H, --hostfile,
# --slots-per-host, --check-build and --version are covered by their own tests below.
HOROVODRUN_ARGS: list[list[str]] = [
    ["-np", "2"], ["--num-proc", "2"], ["-H", "localhost:2"], ["--hosts", "localhost:2"], ["--disable-cache"],
    ["--start-timeout", "40"],
    ["--network-interfaces", "lo"], ["--network-interface", "lo"], ["--output-filename", "OUT"], ["--verbose"],
    ["-p", "2222"], ["--ssh-port", "2222"], ["-i", "key"], ["--ssh-identity-file", "key"],
    ["--fusion-threshold-mb", "32"], ["--cycle-time-ms", "2.5"], ["--cache-capacity", "512"],
    ["--hierarchical-allreduce"], ["--no-hierarchical-allreduce"], ["--hierarchical-allgather"],
    ["--no-hierarchical-allgather"], ["--torus-allreduce"], ["--no-torus-allreduce"], ["--autotune"],
    ["--no-autotune"], ["--autotune-log-file", "a.csv"], ["--autotune-warmup-samples", "3"],
    ["--autotune-steps-per-sample", "10"], ["--autotune-bayes-opt-max-samples", "20"],
    ["--autotune-gaussian-process-noise", "0.8"], ["--min-np", "1"], ["--min-num-proc", "1"],
    ["--max-np", "3"], ["--max-num-proc", "3"], ["--elastic-timeout", "600"], ["--reset-limit", "2"],
    ["--blacklist-cooldown-range", "60", "300"], ["--timeline-filename", "t.json"], ["--timeline-mark-cycles"],
    ["--no-timeline-mark-cycles"], ["--no-stall-check"], ["--stall-check"],
    ["--stall-check-warning-time-seconds", "30"], ["--stall-check-shutdown-time-seconds", "90"],
    ["--mpi-threads-disable"], ["--no-mpi-threads-disable"], ["--mpi-args=--map-by ppr:6:node"], ["--tcp"],
    ["--binding-args=--rankfile f"], ["--num-nccl-streams", "2"], ["--thread-affinity", "1"],
    ["--gloo-timeout-seconds", "45"], ["--log-level", "INFO"], ["--log-with-timestamp"],
    ["--log-without-timestamp"], ["-prefix-timestamp"], ["--prefix-output-with-timestamp"],
    ["--log-hide-timestamp"], ["--no-log-hide-timestamp"], ["--gloo"], ["--mpi"], ["--jsrun"],
    ["--config-file", "CONFIG"], ["-hostfile", "HOSTFILE"], ["--hostfile", "HOSTFILE"],
    ["--host-discovery-script", "SCRIPT"],
]


@pytest.fixture
def config_yaml(tmp_path: Path) -> Path:
    path = tmp_path / "hvd.yaml"
    path.write_text("params:\n  fusion_threshold_mb: 16\n  cycle_time_ms: 1\n"
                    "stall_check:\n  enabled: true\n  warning_time_seconds: 20\n"
                    "logging:\n  level: debug\n  with_timestamp: false\n"
                    "timeline:\n  filename: tl.json\n  mark_cycles: true\n")
    return path


def test_every_horovodrun_flag_parses(config_yaml: Path, tmp_path: Path) -> None:
    # One test for all of them: each case is a parse, and the per-test fixtures would cost more than it.
    hostfile, script = tmp_path / "hosts", tmp_path / "discover.sh"
    hostfile.write_text("localhost slots=2\n")
    script.write_text("#!/bin/sh\necho localhost:2\n")
    script.chmod(0o755)
    paths = {"CONFIG": str(config_yaml), "OUT": str(tmp_path), "HOSTFILE": str(hostfile), "SCRIPT": str(script)}
    for given in HOROVODRUN_ARGS:
        flag = [paths.get(a, a) for a in given]
        np_given = flag[0] in ("-np", "--num-proc")
        cfg = parse_config(([] if np_given else ["-np", "2"]) + flag + ["true"])
        assert cfg.np == 2 and cfg.command == ("true",), flag


def test_effective_flags_set_horovods_variables_for_the_ranks() -> None:
    cfg = parse_config(["-np", "2", "--fusion-threshold-mb", "4", "--stall-check-warning-time-seconds", "7",
                        "--stall-check-shutdown-time-seconds", "20", "--gloo-timeout-seconds", "45",
                        "--log-level", "debug", "--log-without-timestamp", "--tcp", "--elastic-timeout", "90",
                        "true"])
    env = cfg.job_env()
    assert env["HOROVOD_FUSION_THRESHOLD"] == str(4 * 1024 * 1024)
    assert env["HOROVOD_STALL_CHECK_TIME_SECONDS"] == "7"
    assert env["HOROVOD_STALL_SHUTDOWN_TIME_SECONDS"] == "20"
    assert env["HOROVOD_GLOO_TIMEOUT_SECONDS"] == "45"
    assert env["HOROVOD_LOG_LEVEL"] == "DEBUG" and env["HOROVOD_LOG_HIDE_TIME"] == "1"
    assert env["NCCL_IB_DISABLE"] == "1" and env["PHALANX_ELASTIC_TIMEOUT_S"] == "90"
    assert cfg.to_spec().env == env
    assert cfg.warnings == ()


def test_stall_check_switches() -> None:
    assert parse_config(["-np", "2", "--no-stall-check", "true"]).job_env()["HOROVOD_STALL_CHECK_DISABLE"] == "1"
    assert parse_config(["-np", "2", "--stall-check", "true"]).job_env()["HOROVOD_STALL_CHECK_DISABLE"] == "0"
    assert "HOROVOD_STALL_CHECK_DISABLE" not in parse_config(["-np", "2", "true"]).job_env()


def test_unset_flags_add_no_variables() -> None:
    assert parse_config(["-np", "2", "true"]).job_env() == {}


@pytest.mark.parametrize(
    ("flags", "named"),
    [
        (["--autotune", "--autotune-log-file", "a.csv"], ["--autotune", "--autotune-log-file"]),
        (["--mpi"], ["--mpi"]),
        (["--jsrun"], ["--jsrun"]),
        (["--cycle-time-ms", "5"], ["--cycle-time-ms"]),
        (["--hierarchical-allreduce", "--num-nccl-streams", "2"], ["--hierarchical-allreduce", "--num-nccl-streams"]),
        (["--blacklist-cooldown-range", "1", "2", "-p", "22"], ["--blacklist-cooldown-range", "--ssh-port"]),
    ],
)
def test_noop_flags_warn_once_naming_the_flag(flags: list[str], named: list[str]) -> None:
    warnings = parse_config(["-np", "2", *flags, "true"]).warnings
    assert len(warnings) == len(named)
    for warning, flag in zip(warnings, named, strict=True):
        assert warning.startswith(f"{flag} changes nothing: ")


def test_switching_off_what_phalanx_never_does_is_silent() -> None:
    assert parse_config(["-np", "2", "--no-autotune", "--no-hierarchical-allreduce", "true"]).warnings == ()


class _NoLaunch:
    def __init__(self, spec: object) -> None:
        self.spec = spec

    def run(self) -> list[None]:
        return []


def test_main_prints_each_warning_once(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("phalanx.cli.main.LocalLauncher", _NoLaunch)
    assert main(["-np", "1", "--autotune", "--mpi", "true"]) == 0
    err = capsys.readouterr().err
    assert err.count("phalanxrun: warning: --autotune changes nothing") == 1
    assert err.count("phalanxrun: warning: --mpi changes nothing") == 1


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--fusion-threshold-mb", "-1"], "fusion-threshold-mb=-1 must be >= 0"),
        (["--stall-check-warning-time-seconds", "-5"], "must be >= 0"),
        (["--autotune-gaussian-process-noise", "1.5"], r"must be in \[0, 1\]"),
        (["--hostfile", "hosts.txt"], "--hostfile 'hosts.txt' cannot be read"),
        (["--slots-per-host", "0"], "--slots-per-host=0: give the ranks one host may run"),
        (["--slots-per-host", "-2"], "--slots-per-host=-2: give the ranks one host may run"),
        (["-H", "localhost", "--slots-per-host", "1"], "np=2 is more than the 1 slot"),
    ],
)
def test_bad_values_are_refused_before_anything_starts(argv: list[str], message: str) -> None:
    with pytest.raises(InvalidArgumentError, match=message):
        parse_config(["-np", "2", *argv, "true"])


def test_slots_per_host_gives_slots_to_hosts_listed_without_theirs(tmp_path: Path) -> None:
    # -H and a hostfile: a bare host has --slots-per-host slots (without it, one: -np 3 would not fit).
    with pytest.raises(InvalidArgumentError, match="np=3 is more than the 1 slot"):
        parse_config(["-np", "3", "-H", "localhost", "true"])
    assert parse_config(["-np", "3", "-H", "localhost", "--slots-per-host", "3", "true"]).warnings == ()
    hostfile = tmp_path / "hosts.txt"
    hostfile.write_text("localhost\n")
    parse_config(["-np", "3", "--hostfile", str(hostfile), "--slots-per-host", "3", "true"])
    with pytest.raises(InvalidArgumentError, match="np=4 is more than the 3 slot"):  # host:slots wins over the flag
        parse_config(["-np", "4", "-H", "localhost:3", "--slots-per-host", "8", "true"])
    # The discovery script's bare lines (horovodrun's own use of the flag), for an elastic job.
    script = tmp_path / "discover.sh"
    script.write_text("#!/bin/sh\necho localhost\n")
    script.chmod(0o755)
    cfg = parse_config(["-np", "2", "--host-discovery-script", str(script), "--slots-per-host", "4", "true"])
    assert cfg.elastic is not None and cfg.elastic.slots_per_host == 4
    from phalanx.launch.discovery import HostDiscovery

    assert HostDiscovery(str(script), lambda hosts: None, default_slots=4).poll() == {"localhost": 4}
    # Without any host list it changes nothing, as in horovodrun (localhost:np), and says so.
    cfg = parse_config(["-np", "2", "--slots-per-host", "1", "true"])
    assert [w for w in cfg.warnings if w.startswith("--slots-per-host changes nothing")], cfg.warnings


def test_log_level_choices_are_horovods() -> None:
    with pytest.raises(SystemExit):
        parse_config(["-np", "2", "--log-level", "LOUD", "true"])


def test_min_and_max_num_proc_are_the_elastic_bounds() -> None:
    cfg = parse_config(["-np", "2", "--min-num-proc", "1", "--max-num-proc", "4", "true"])
    assert cfg.elastic is not None
    assert (cfg.elastic.policy.min_np, cfg.elastic.policy.max_np) == (1, 4)


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    for flag in ("-v", "--version"):
        with pytest.raises(SystemExit) as exit_info:
            parse_config([flag])
        assert exit_info.value.code == 0
        out = capsys.readouterr().out
        assert __version__ in out and HOROVOD_API_VERSION in out


def test_check_build_needs_no_np_and_reports_what_is_installed(capsys: pytest.CaptureFixture[str]) -> None:
    for flag in ("-cb", "--check-build"):
        with pytest.raises(SystemExit) as exit_info:
            parse_config([flag])
        assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert f"Horovod API v{HOROVOD_API_VERSION}" in out
    assert "[X] PyTorch" in out and "[X] Gloo" in out and "[ ] MPI" in out and "[ ] MXNet" in out


def test_check_build_report_marks_what_is_missing() -> None:
    text = build_info.report(build_info.BuildInfo(tensorflow=False, torch=True, gloo=True, nccl=False, spark=False))
    assert "[ ] TensorFlow" in text and "[ ] NCCL" in text and "[X] PyTorch" in text


def test_config_file_fills_what_the_command_line_left_unset(config_yaml: Path) -> None:
    cfg = parse_config(["-np", "2", "--config-file", str(config_yaml), "--fusion-threshold-mb", "2", "true"])
    env = cfg.job_env()
    assert env["HOROVOD_FUSION_THRESHOLD"] == str(2 * 1024 * 1024)  # the command line wins
    assert env["HOROVOD_STALL_CHECK_TIME_SECONDS"] == "20" and env["HOROVOD_STALL_CHECK_DISABLE"] == "0"
    assert env["HOROVOD_LOG_LEVEL"] == "DEBUG" and env["HOROVOD_LOG_HIDE_TIME"] == "1"
    assert env["HOROVOD_TIMELINE"].endswith("tl.json") and env["HOROVOD_TIMELINE_MARK_CYCLES"] == "1"
    assert [w.split(" ")[0] for w in cfg.warnings] == ["--cycle-time-ms"]


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("params:\n  fusion_threshold: 1\n", "unknown key params.fusion_threshold"),
        ("tuning:\n  x: 1\n", "unknown section 'tuning'"),
        ("params:\n  fusion_threshold_mb: lots\n", "params.fusion_threshold_mb must be int"),
        ("stall_check:\n  enabled: 1\n", "stall_check.enabled must be bool"),
        ("controller: nccl\n", "controller 'nccl' is not gloo or mpi"),
        ("- a\n- b\n", "must hold a mapping"),
        ("params: [\n", "not valid YAML"),
    ],
)
def test_bad_config_file_is_refused(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(InvalidArgumentError, match=re.escape(message)):
        parse_config(["-np", "2", "--config-file", str(path), "true"])


def test_missing_config_file_is_named(tmp_path: Path) -> None:
    with pytest.raises(InvalidArgumentError, match="cannot be read"):
        parse_config(["-np", "2", "--config-file", str(tmp_path / "none.yaml"), "true"])


def test_prefix_output_with_timestamp(monkeypatch: pytest.MonkeyPatch) -> None:
    assert parse_config(["-np", "2", "--prefix-output-with-timestamp", "true"]).to_spec().prefix_timestamp
    assert not parse_config(["-np", "2", "true"]).to_spec().prefix_timestamp
    out = io.StringIO()
    monkeypatch.setattr("sys.stdout", out)
    ConsoleSink(prefix=True, timestamp=True).write(LogLine(rank=1, stream=Stream.STDOUT, text="hello"))
    line = out.getvalue()
    stamp, _, rest = line.partition("[1]<stdout>:")
    assert rest == "hello\n"
    time.strptime(stamp, "%a %b %d %H:%M:%S %Y")  # time.asctime's layout, as horovodrun writes it


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["-np", str(10**20), "true"], "at most 65536"),
        (["-np", "2", "--start-timeout", "nan", "true"], "finite number of seconds"),
        (["-np", "2", "--start-timeout", "inf", "true"], "finite number of seconds"),
        (["-np", "2", "--output-filename", "/proc/1/no/such", "true"], "cannot create or write"),
        (["-np", "2", "--timeline-filename", "/proc/1/no/t.json", "true"], "cannot write a file there"),
    ],
)
def test_absurd_inputs_are_one_line_before_any_rank_starts(argv: list[str], message: str) -> None:
    with pytest.raises(InvalidArgumentError, match=message):
        parse_config(argv)


def test_binary_hostfile_and_start_timeout_variable(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "hosts").write_bytes(b"\xff\xfe\x00node1")
    with pytest.raises(InvalidArgumentError, match="is not a text file"):
        parse_config(["-np", "2", "--hostfile", str(tmp_path / "hosts"), "true"])
    monkeypatch.setenv("HOROVOD_START_TIMEOUT", "nan")
    with pytest.raises(InvalidArgumentError, match="HOROVOD_START_TIMEOUT=nan"):
        parse_config(["-np", "2", "true"])


def test_a_script_given_as_the_command_suggests_python(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.py").write_text("print(1)\n")
    with pytest.raises(InvalidArgumentError, match=re.escape("phalanxrun -np 2 python train.py --lr 1")):
        parse_config(["-np", "2", "train.py", "--lr", "1"])
    (tmp_path / "run.sh").write_text("#!/bin/sh\n")
    (tmp_path / "run.sh").chmod(0o755)
    with pytest.raises(InvalidArgumentError, match=re.escape("phalanxrun -np 2 ./run.sh")):
        parse_config(["-np", "2", "run.sh"])


def test_a_bad_flag_value_is_one_line_and_a_hint(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["-np", "abc", "python", "x.py"])
    assert info.value.code == 2
    assert capsys.readouterr().err == ("phalanxrun: error: argument -np/--num-proc: invalid int value: 'abc'\n"
                                       "Run 'phalanxrun --help' for the flags and examples.\n")


def test_help_leads_with_examples_and_ends_with_the_flags_that_change_nothing(
        capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["--help"])
    text = capsys.readouterr().out
    head = text.split("positional arguments:")[0]
    assert head.count("phalanxrun -np") == 6 and "--hostfile" in head and "--min-np" in head  # usage + 5
    groups = re.findall(r"^(\S[^\n]*):$", text, re.M)
    assert groups[-1].startswith("accepted for horovodrun command lines; they change nothing here")
    noop = text.split(groups[-1])[1]
    assert "--autotune " in noop and "--gloo" in noop and "--fusion-threshold-mb FUSION" not in noop
    assert "as horovodrun" not in text
