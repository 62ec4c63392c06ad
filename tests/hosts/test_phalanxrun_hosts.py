"""phalanxrun across two simulated hosts (2 slots each) over ssh: layout, collectives, failures, lifetime."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from tests.hosts.simhosts import Cluster

from phalanx.launch.proctree import cmdline, descendants

pytestmark = [pytest.mark.multiprocess, pytest.mark.hosts, pytest.mark.timeout(180)]

JOB = "tests/hosts/job_collectives.py"
#: tests/examples' floor for a 3-epoch run on the digits (chance is 0.1).
ACCURACY_FLOOR = 0.8


def phalanxrun(cluster: Cluster, *args: str) -> list[str]:
    return [sys.executable, "-m", "phalanx.cli.main", "-i", str(cluster.key), "--start-timeout", "60", *args]


def results(stdout: str) -> dict[int, dict[str, Any]]:
    out = {}
    for line in stdout.splitlines():
        _, sep, body = line.partition("RESULT ")
        if sep:
            record = json.loads(body)
            out[record["rank"]] = record
    return out


def expected(members: list[int]) -> dict[str, Any]:
    n = len(members)
    total = sum(r + 1 for r in members)
    return {
        "small": [float(total)], "big": [total / n],
        "gathered": [[r, 2 * r] for r in members], "bcast": [members[-1] * 10.0] * 3,
    }


def check_set(record: dict[str, Any], members: list[int]) -> None:
    want = expected(members)
    for key, value in want.items():
        assert record[key] == value, (key, record[key], value)
    me, n = record["me"], len(members)
    base = sum(members)
    assert record["scattered"] == [float(n * (2 * me) + base), float(n * (2 * me + 1) + base)]
    assert record["a2a"] == [float(r * 100 + me) for r in members]


def check_job(stdout: str, first: str = "hosta", second: str = "hostb", quick: bool = False) -> None:
    """Every rank's layout (``first`` holds ranks 0-1) and every collective's values on every path."""
    got = results(stdout)
    assert sorted(got) == [0, 1, 2, 3], stdout[-3000:]
    layout = [(got[r]["host"], got[r]["local_rank"], got[r]["local_size"], got[r]["cross_rank"],
               got[r]["cross_size"]) for r in range(4)]
    assert layout == [(first, 0, 2, 0, 2), (first, 1, 2, 0, 2), (second, 0, 2, 1, 2), (second, 1, 2, 1, 2)]
    # One machine (one boot id) but two /dev/shm: shared memory is keyed by the /dev/shm, not the name.
    machine = [got[r]["machine"] for r in range(4)]
    assert machine[0] == machine[1] != machine[2] == machine[3]
    assert machine[0].split("/")[0] == machine[2].split("/")[0]
    for r in range(4):
        check_set(got[r]["global"], [0, 1, 2, 3])
    if quick:
        return
    for r in (0, 1):
        check_set(got[r]["local"], [0, 1])
    for r in (0, 2):
        check_set(got[r]["cross"], [0, 2])


def test_two_hosts_layout_and_collectives(cluster: Cluster) -> None:
    done = cluster.run_on("hosta", phalanxrun(cluster, "-np", "4", "-H", "hosta:2,hostb:2", sys.executable, JOB),
                          timeout=150)
    assert done.returncode == 0, done.stderr[-3000:] + done.stdout[-3000:]
    check_job(done.stdout)
    # Each host's lines arrive on the driver, prefixed by rank.
    assert {line.split("]")[0] for line in done.stdout.splitlines() if "RESULT" in line} == {"[0", "[1", "[2", "[3"}
    assert cluster.wait_clean(10.0) == {}


def test_unchanged_horovod_script_trains_to_the_local_accuracy(cluster: Cluster, tmp_path: Path) -> None:
    """examples/horovod_train.py on 2 hosts x 2 ranks reaches the floor tests/examples asserts locally."""
    script = str(cluster.workdir / "examples" / "horovod_train.py")
    done = cluster.run_on("hosta", phalanxrun(cluster, "-np", "4", "-H", "hosta:2,hostb:2", sys.executable, script,
                                              "--epochs", "3"), timeout=170, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:] + done.stdout[-3000:]
    found = re.search(r"\[0\]<stdout>:test accuracy: ([0-9.]+)", done.stdout)
    assert found is not None, done.stdout[-3000:]
    assert float(found.group(1)) > ACCURACY_FLOOR
    assert (tmp_path / "digits_horovod.pt").is_file()
    assert cluster.wait_clean(10.0) == {}


def test_a_host_refusing_ssh_is_named_before_anything_starts(cluster: Cluster) -> None:
    done = cluster.run_on("hosta", phalanxrun(cluster, "-np", "4", "-H", "hosta:2,hostb:2", "-p", "2",
                                              sys.executable, JOB), timeout=60)
    assert done.returncode == 1
    assert "host check failed" in done.stderr and "host 'hostb': ssh could not connect" in done.stderr
    assert "Connection refused" in done.stderr
    assert "RESULT" not in done.stdout
    assert cluster.wait_clean(10.0) == {}


def test_a_rank_killed_on_host_b_is_the_root_cause_and_nothing_is_left(cluster: Cluster) -> None:
    done = cluster.run_on("hosta", phalanxrun(cluster, "-np", "4", "-H", "hosta:2,hostb:2", sys.executable,
                                              "tests/hosts/job_lifetime.py", "kill"), timeout=150)
    assert done.returncode == 128 + 9, done.stderr[-3000:]
    first = done.stderr.split("Also failed")[0]
    assert "rank 3" in first and "SIGKILL" in first and "[on host hostb]" in first, done.stderr[-3000:]
    assert cluster.wait_clean(10.0) == {}


def test_driver_killed_leaves_nothing_on_any_host(cluster: Cluster) -> None:
    argv = cluster.argv_on("hosta", phalanxrun(cluster, "-np", "4", "-H", "hosta:2,hostb:2", sys.executable,
                                               "tests/hosts/job_lifetime.py", "wait"))
    driver = subprocess.Popen(argv, cwd=cluster.workdir, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    assert driver.stdout is not None
    ready: set[str] = set()
    for line in driver.stdout:
        if "READY" in line:
            ready.add(line.split("READY")[1].strip())
        if len(ready) == 4:
            break
    assert len(ready) == 4
    assert cluster.leftovers().keys() == {"hosta", "hostb"}
    driver.kill()
    driver.wait()
    assert cluster.wait_clean(10.0) == {}


def test_a_dropped_ssh_connection_ends_the_job_naming_the_host(cluster: Cluster) -> None:
    argv = cluster.argv_on("hosta", phalanxrun(cluster, "-np", "4", "-H", "hosta:2,hostb:2", sys.executable,
                                               "tests/hosts/job_lifetime.py", "wait"))
    driver = subprocess.Popen(argv, cwd=cluster.workdir, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert driver.stdout is not None and driver.stderr is not None
    ready = 0
    for line in driver.stdout:
        ready += "READY" in line
        if ready == 4:
            break
    ssh = [p for p in descendants(driver.pid) if cmdline(p).startswith("ssh ")]
    assert len(ssh) == 1, [cmdline(p) for p in descendants(driver.pid)]
    os.kill(ssh[0], signal.SIGKILL)
    _, stderr = driver.communicate(timeout=120)
    assert driver.returncode != 0
    # hostb's agent saw its stdin end and stopped its ranks: the root cause is one of them, on hostb.
    assert "[on host hostb]" in stderr.split("Also failed")[0], stderr[-3000:]
    assert cluster.wait_clean(10.0) == {}
