"""Host lists, hostfiles, placement and locality (no processes)."""

from __future__ import annotations

import socket
import sys
from pathlib import Path

import pytest

from phalanx.env import assign_ranks
from phalanx.errors import InvalidArgumentError, PhalanxError
from phalanx.launch.hosts import HostSlots, is_local, parse_hostfile, parse_hosts, place
from phalanx.launch.ssh import SshOptions, agent_command, check_hosts, host_problems, route_address, ssh_argv


def test_parse_hosts_with_and_without_slots() -> None:
    assert parse_hosts("a:2, b:3,c") == [HostSlots("a", 2), HostSlots("b", 3), HostSlots("c", 1)]
    # --slots-per-host: the slots of a host listed without its own; host:N wins
    assert parse_hosts("a:2,c", default_slots=4) == [HostSlots("a", 2), HostSlots("c", 4)]


@pytest.mark.parametrize("text, needle", [
    ("a:0", "slots '0'"), ("a:x", "slots 'x'"), ("a:2,,b:1", "empty entry"), ("a:1,a:2", "named twice"),
    ("-oProxyCommand=x:1", "not a host name"), ("a b:1", "not a host name"), ("a;rm:1", "not a host name"),
])
def test_parse_hosts_refuses_bad_entries(text: str, needle: str) -> None:
    with pytest.raises(InvalidArgumentError, match=needle):
        parse_hosts(text)


def test_hostfile_format(tmp_path: Path) -> None:
    f = tmp_path / "hosts"
    f.write_text("# cluster\nnode1 slots=4\n\nnode2   # one slot\n10.0.0.3 slots=2\n")
    assert parse_hostfile(str(f)) == [HostSlots("node1", 4), HostSlots("node2", 1), HostSlots("10.0.0.3", 2)]
    assert parse_hostfile(str(f), default_slots=3)[1] == HostSlots("node2", 3)  # --slots-per-host


def test_deepspeed_hostfile_format(tmp_path: Path) -> None:
    """DeepSpeed's hostfile (deepspeed.launcher.runner._parse_hostfile: ``host slots=N``, any blanks between,
    ``#`` comment lines) is Horovod's: phalanxrun --hostfile takes it as it is."""
    f = tmp_path / "hostfile"
    f.write_text("# DeepSpeed hostfile\nworker-1 slots=4\nworker-2\tslots=4\n  \n")
    assert parse_hostfile(str(f)) == [HostSlots("worker-1", 4), HostSlots("worker-2", 4)]


@pytest.mark.parametrize("text, needle", [
    ("node1 slots=two\n", ":1: 'node1 slots=two' is not"), ("a slots=1\nb cpus=2\n", ":2:"),
    ("# nothing\n", "names no host"), ("a slots=0\n", "slots '0'"),
])
def test_hostfile_errors_name_the_line(tmp_path: Path, text: str, needle: str) -> None:
    f = tmp_path / "hosts"
    f.write_text(text)
    with pytest.raises(InvalidArgumentError, match=needle):
        parse_hostfile(str(f))


def test_missing_hostfile() -> None:
    with pytest.raises(InvalidArgumentError, match="cannot be read"):
        parse_hostfile("/nonexistent/hostfile")


def test_placement_fills_each_host_in_order() -> None:
    hosts = [HostSlots("a", 2), HostSlots("b", 2)]
    assert place(hosts, 4) == ["a", "a", "b", "b"]
    assert place(hosts, 3) == ["a", "a", "b"]
    layout = assign_ranks(place(hosts, 4))
    assert [(w.local_rank, w.local_size, w.cross_rank, w.cross_size) for w in layout] == [
        (0, 2, 0, 2), (1, 2, 0, 2), (0, 2, 1, 2), (1, 2, 1, 2)]


def test_placement_refuses_more_ranks_than_slots() -> None:
    with pytest.raises(InvalidArgumentError, match="np=5 is more than the 4 slot"):
        place([HostSlots("a", 2), HostSlots("b", 2)], 5)


def test_this_machine_is_local_by_any_of_its_names() -> None:
    for name in ("localhost", "127.0.0.1", socket.gethostname()):
        assert is_local(name)
    assert not is_local("host.invalid")


def test_ssh_command_line_holds_no_secret_and_quotes_the_remote_command() -> None:
    argv = ssh_argv("b", SshOptions(port=2222, identity_file="/k"), agent_command("/py thon", "/w d"))
    assert argv[:2] == ["ssh", "-T"] and "BatchMode=yes" in argv
    assert argv[argv.index("-p") + 1] == "2222" and argv[argv.index("-i") + 1] == "/k"
    assert argv[-2:] == ["b", "cd '/w d' && exec '/py thon' -m phalanx.launch.host_agent"]


def test_route_address_of_loopback() -> None:
    assert route_address("127.0.0.1") == "127.0.0.1"
    with pytest.raises(InvalidArgumentError, match=r"host\.invalid"):
        route_address("host.invalid")


def test_hosts_spec_checks_the_ssh_options(tmp_path: Path) -> None:
    from phalanx.launch.api import hosts_spec

    key = tmp_path / "id"
    key.write_text("k")
    spec = hosts_spec([HostSlots("b", 2)], 2222, str(key), "eth1, eth0", 60.0, python="/py", forward_env={"A": "1"})
    assert (spec.ssh.port, spec.ssh.identity_file, spec.interfaces, spec.python) == (2222, str(key), ("eth1", "eth0"),
                                                                                       "/py")
    assert spec.ssh.connect_timeout_s == 30.0 and spec.forward_env == {"A": "1"}
    assert hosts_spec([HostSlots("b", 1)], None, None, ["eth0"], 5.0).interfaces == ("eth0",)
    with pytest.raises(InvalidArgumentError, match="not a port number"):
        hosts_spec([HostSlots("b", 1)], 70000, None, None, 5.0)
    with pytest.raises(InvalidArgumentError, match="does not exist"):
        hosts_spec([HostSlots("b", 1)], None, str(tmp_path / "missing"), None, 5.0)


def test_forwarded_environment() -> None:
    from phalanx.launch.agent_driver import forwarded_env

    env = {"HOROVOD_FUSION_THRESHOLD": "1", "NCCL_DEBUG": "INFO", "PHALANX_SHM": "0", "PYTHONPATH": "/x",
           "HOME": "/root", "SECRET_TOKEN": "s"}
    assert forwarded_env(env, {"A": "2", "NCCL_DEBUG": "WARN"}) == {
        "HOROVOD_FUSION_THRESHOLD": "1", "NCCL_DEBUG": "WARN", "PHALANX_SHM": "0", "PYTHONPATH": "/x", "A": "2"}


def test_host_check_names_each_host_and_its_cause(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A stand-in ``ssh`` on PATH answers per host: refused (255), no such interpreter (127), or never.
    fake = tmp_path / "ssh"
    fake.write_text('#!/bin/sh\nfor a; do h="$p"; p="$a"; done\ncase "$h" in\n'
                    '  refused) echo "ssh: connect to host refused port 22: Connection refused" >&2; exit 255;;\n'
                    '  nopython) echo "sh: 1: exec: /no/python: not found" >&2; exit 127;;\n'
                    '  silent) exec sleep 30;;\nesac\nexit 0\n')
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:/usr/bin:/bin")
    got = host_problems(["good", "refused", "nopython"], SshOptions(), "/no/python", 30.0)
    got.update(host_problems(["silent"], SshOptions(), "/no/python", 0.3))
    assert sorted(got) == ["nopython", "refused", "silent"]
    assert got["refused"].startswith("host 'refused': ssh could not connect or log in (exit code 255)")
    assert "Connection refused" in got["refused"]
    assert "/no/python -m phalanx.launch.host_agent cannot run there" in got["nopython"]
    assert "not found" in got["nopython"]
    assert got["silent"] == "host 'silent' did not answer over ssh within 0.3 s (raise --start-timeout)"
    with pytest.raises(PhalanxError, match="host check failed:\n  host 'refused'"):
        check_hosts(["good", "refused"], SshOptions(), "/no/python", 30.0)


def test_the_host_check_names_a_working_directory_missing_on_a_host(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """The job used to start and fail 6 s later with 'cd: ...: No such file or directory' (issue 32, item 12)."""
    from phalanx.launch import ssh

    monkeypatch.setattr(ssh, "ssh_argv", lambda host, options, command: ["sh", "-c", command])
    missing = tmp_path / "gone"
    monkeypatch.chdir(tmp_path)
    assert host_problems(["h1"], SshOptions(), sys.executable, 30) == {}  # the directory exists: a real probe
    monkeypatch.setattr(ssh.os, "getcwd", lambda: str(missing))
    problems = host_problems(["h1"], SshOptions(), sys.executable, 30)
    assert f"the working directory {missing} does not exist there" in problems["h1"]


def test_an_agents_end_is_told_by_what_happened_with_its_own_last_line_first() -> None:
    """An agent that died was reported as 'ssh could not connect or lost the connection' though ssh was fine,
    and the root-cause line kept only the first line, not the agent's own error (issue 32, item 12)."""
    from collections import deque

    from phalanx.launch.agent_driver import AgentGroup

    tail = deque(["Warning: Permanently added 'hostb'", "sh: 1: cd: /tmp/job: No such file or directory"])
    ended = AgentGroup._death("hostb", 2, False, [2, 3], tail).splitlines()[0]
    assert ended.startswith("the agent on host hostb ended (exit code 2): sh: 1: cd: /tmp/job: No such file")
    killed = AgentGroup._death("hostb", 255, True, [2], deque()).splitlines()[0]
    assert "died while its ranks ran" in killed and "ssh" not in killed
    refused = AgentGroup._death("hostb", 255, False, [2], deque(["Connection refused"])).splitlines()[0]
    assert refused.startswith("ssh to host hostb could not connect") and "Connection refused" in refused
