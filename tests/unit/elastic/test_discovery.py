"""Host discovery: the script's output, its validation, and what counts on one machine."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from phalanx.cli.main import parse_config
from phalanx.errors import InvalidArgumentError
from phalanx.launch.discovery import HostDiscovery, check_script, local_slots, parse_hosts


def test_parse_hosts_reads_host_slots_lines() -> None:
    assert parse_hosts("localhost:2\n\n# comment\nnode-1:4\nnode-1:1\nsolo\n") == {
        "localhost": 2, "node-1": 5, "solo": 1}
    with pytest.raises(ValueError, match="'localhost:two' is not host:slots"):
        parse_hosts("localhost:two")


def _script(tmp_path: Path, body: str, mode: int = 0o755) -> Path:
    path = tmp_path / "discover.sh"
    path.write_text(f"#!/bin/sh\n{body}\n")
    path.chmod(mode)
    return path


def test_only_this_machines_names_count(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    script = _script(tmp_path, f'echo localhost:1; echo 127.0.0.1:2; echo {socket.gethostname()}:1; echo far:8')
    hosts = HostDiscovery(str(script), lambda hosts: None).poll()
    assert hosts is not None and hosts["far"] == 8
    warned: set[str] = set()
    assert local_slots(hosts, warned) == 4 and warned == {"far"}
    assert "'far'" in caplog.text and "this machine only" in caplog.text
    assert HostDiscovery(str(_script(tmp_path, "exit 3")), lambda hosts: None).poll() is None


def test_the_script_is_checked_before_anything_starts(tmp_path: Path) -> None:
    with pytest.raises(InvalidArgumentError, match="is not a file"):
        check_script(str(tmp_path / "missing.sh"))
    with pytest.raises(InvalidArgumentError, match="not executable"):
        check_script(str(_script(tmp_path, "echo localhost:2", mode=0o644)))
    script = _script(tmp_path, "echo localhost:2")
    config = parse_config(["-np", "2", "--max-np", "4", "--host-discovery-script", str(script), "true"])
    assert config.elastic is not None and config.elastic.discovery_script == str(script)
    assert config.elastic.policy.max_np == 4
