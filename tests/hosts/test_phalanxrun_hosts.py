"""phalanxrun across two simulated hosts (2 slots each) over ssh: layout, collectives, failures, lifetime."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
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


def check_job(stdout: str, first: str = "hosta", second: str = "hostb", quick: bool = False, per_host: int = 2) -> None:
    """Every rank's layout (``first`` holds the first ``per_host`` ranks) and every collective's values on every
    path (``quick``: the global set only)."""
    got = results(stdout)
    n = 2 * per_host
    assert sorted(got) == list(range(n)), stdout[-3000:]
    layout = [(got[r]["host"], got[r]["local_rank"], got[r]["local_size"], got[r]["cross_rank"],
               got[r]["cross_size"]) for r in range(n)]
    assert layout == [(h, local, per_host, cross, 2) for cross, h in enumerate((first, second))
                      for local in range(per_host)]
    # One machine (one boot id) but two /dev/shm: shared memory is keyed by the /dev/shm, not the name.
    machine = [got[r]["machine"] for r in range(n)]
    assert len(set(machine[:per_host])) == len(set(machine[per_host:])) == 1 and machine[0] != machine[-1]
    assert machine[0].split("/")[0] == machine[-1].split("/")[0]
    for r in range(n):
        check_set(got[r]["global"], list(range(n)))
    if quick:
        return
    for r in (0, 1):
        check_set(got[r]["local"], [0, 1])
    for r in (0, 2):
        check_set(got[r]["cross"], [0, 2])


def _shm(cluster: Cluster) -> dict[str, set[str]]:
    """Each host's /dev/shm (its private tmpfs), as seen through its sshd's root."""
    return {name: set(os.listdir(f"/proc/{h.sshd.pid}/root/dev/shm")) for name, h in cluster.hosts.items()}


def _until_ready(driver: subprocess.Popen[str], n: int) -> str:
    """The driver's output up to the ``n``-th READY line."""
    assert driver.stdout is not None
    seen, ready = [], 0
    for line in driver.stdout:
        seen.append(line)
        ready += "READY" in line
        if ready == n:
            break
    return "".join(seen)


def test_layout_and_collectives_then_ctrl_c_stops_every_host(cluster: Cluster) -> None:
    """Layout and collectives (every path) on 2 hosts x 2 ranks, each host's ranks forked from its agent's
    template (issue 36); then SIGINT to phalanxrun (Ctrl-C) stops every host: no process and no /dev/shm
    file is left on either."""
    before = _shm(cluster)
    argv = cluster.argv_on("hosta", phalanxrun(cluster, "-np", "4", "-H", "hosta:2,hostb:2", sys.executable, JOB,
                                               "wait"))
    driver = subprocess.Popen(argv, cwd=cluster.workdir, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    stdout = _until_ready(driver, 4)
    check_job(stdout)
    # Each host's two ranks were forked by one template there (its agent's), not started as interpreters.
    parents = [results(stdout)[r]["parent"] for r in range(4)]
    assert all("phalanx.worker.template" in p["cmdline"] for p in parents), parents
    assert parents[0]["pid"] == parents[1]["pid"] and parents[2]["pid"] == parents[3]["pid"], parents
    # Each host's lines arrive on the driver, prefixed by rank.
    assert {line.split("]")[0] for line in stdout.splitlines() if "RESULT" in line} == {"[0", "[1", "[2", "[3"}
    assert cluster.leftovers().keys() == {"hosta", "hostb"}
    driver.send_signal(signal.SIGINT)
    _, stderr = driver.communicate(timeout=60)
    assert driver.returncode != 0, stderr[-3000:]
    cluster.wait_clean(10.0)
    assert _shm(cluster) == before


def test_unchanged_horovod_script_trains_to_the_local_accuracy(cluster: Cluster, tmp_path: Path) -> None:
    """examples/horovod_train.py on 2 hosts x 2 ranks reaches the floor tests/examples asserts locally; the hosts
    are named without their slots, which horovodrun's --slots-per-host gives them."""
    script = str(cluster.workdir / "examples" / "horovod_train.py")
    done = cluster.run_on("hosta", phalanxrun(cluster, "-np", "4", "-H", "hosta,hostb", "--slots-per-host", "2",
                                              sys.executable, script, "--epochs", "3",
                                              "--out", str(tmp_path / "digits_horovod.pt")),
                           timeout=170, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:] + done.stdout[-3000:]
    steps = [line for line in done.stderr.splitlines() if line.startswith("phalanx: ")]
    assert steps[:2] == ["phalanx: checking 1 host(s) over ssh",
                         "phalanx: starting the ranks' agents on 2 host(s), 1 over ssh"], done.stderr[-3000:]
    found = re.search(r"\[0\]<stdout>:test accuracy: ([0-9.]+)", done.stdout)
    assert found is not None, done.stdout[-3000:]
    assert float(found.group(1)) > ACCURACY_FLOOR
    assert (tmp_path / "digits_horovod.pt").is_file()
    cluster.wait_clean(10.0)


def test_a_host_refusing_ssh_is_named_before_anything_starts(cluster: Cluster) -> None:
    done = cluster.run_on("hosta", phalanxrun(cluster, "-np", "4", "-H", "hosta:2,hostb:2", "-p", "2",
                                              sys.executable, JOB), timeout=60)
    assert done.returncode == 1
    assert "host check failed" in done.stderr and "host 'hostb': ssh could not connect" in done.stderr
    assert "Connection refused" in done.stderr
    assert "RESULT" not in done.stdout
    cluster.wait_clean(10.0)


def test_a_rank_killed_on_host_b_is_the_root_cause_and_nothing_is_left(cluster: Cluster) -> None:
    done = cluster.run_on("hosta", phalanxrun(cluster, "-np", "2", "-H", "hosta:1,hostb:1", sys.executable,
                                              "tests/hosts/job_lifetime.py", "kill"), timeout=150)
    assert done.returncode == 128 + 9, done.stderr[-3000:]
    first = done.stderr.split("Also failed")[0]
    assert "rank 1" in first and "SIGKILL" in first and "[on host hostb]" in first, done.stderr[-3000:]
    cluster.wait_clean(10.0)


def test_driver_killed_leaves_nothing_on_any_host(cluster: Cluster) -> None:
    argv = cluster.argv_on("hosta", phalanxrun(cluster, "-np", "4", "-H", "hosta:2,hostb:2", sys.executable,
                                               "tests/hosts/job_lifetime.py", "wait"))
    driver = subprocess.Popen(argv, cwd=cluster.workdir, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    assert _until_ready(driver, 4).count("READY") == 4
    assert cluster.leftovers().keys() == {"hosta", "hostb"}
    driver.kill()
    driver.wait()
    cluster.wait_clean(10.0)


def test_a_dropped_ssh_connection_ends_the_job_naming_the_host(cluster: Cluster) -> None:
    argv = cluster.argv_on("hosta", phalanxrun(cluster, "-np", "4", "-H", "hosta:2,hostb:2", sys.executable,
                                               "tests/hosts/job_lifetime.py", "wait"))
    driver = subprocess.Popen(argv, cwd=cluster.workdir, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    _until_ready(driver, 4)
    ssh = [p for p in descendants(driver.pid) if cmdline(p).startswith("ssh ")]
    assert len(ssh) == 1, [cmdline(p) for p in descendants(driver.pid)]
    os.kill(ssh[0], signal.SIGKILL)
    _, stderr = driver.communicate(timeout=120)
    assert driver.returncode != 0
    # hostb's agent saw its stdin end and stopped its ranks: the root cause is one of them, on hostb.
    assert "[on host hostb]" in stderr.split("Also failed")[0], stderr[-3000:]
    cluster.wait_clean(10.0)



def test_a_killed_agent_is_the_root_cause_named_first(cluster: Cluster) -> None:
    """SIGKILL of hostb's agent mid-training used to be blamed on a survivor's collective error, hostb
    appearing lower down as 'exit code 255; ssh could not connect or lost the connection' though ssh was
    fine (issue 32, items 9 and 12)."""
    argv = cluster.argv_on("hosta", phalanxrun(cluster, "-np", "4", "-H", "hosta:2,hostb:2", sys.executable,
                                               "tests/hosts/job_lifetime.py", "train"))
    driver = subprocess.Popen(argv, cwd=cluster.workdir, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    _until_ready(driver, 4)
    agents = [p for p in cluster.hosts["hostb"].pids() if "phalanx.launch.host_agent" in cmdline(p)]
    assert len(agents) == 1, [cmdline(p) for p in cluster.hosts["hostb"].pids()]
    os.kill(agents[0], signal.SIGKILL)
    _, stderr = driver.communicate(timeout=120)
    assert driver.returncode != 0
    first = stderr.split("Also failed")[0]
    assert "the agent on host hostb died while its ranks ran" in first, stderr[-3000:]
    assert "ssh could not connect" not in stderr, stderr[-3000:]
    cluster.wait_clean(10.0)


def test_a_host_cut_off_silently_is_named_within_the_gloo_timeout(cluster: Cluster) -> None:
    """hostb's link cut (no packets, no reset): the job printed only stall warnings and waited for good, and
    --gloo-timeout-seconds had no effect (issue 32, item 10). The agents' heartbeats name hostb first, within
    the user's gloo timeout."""
    argv = cluster.argv_on("hosta", phalanxrun(cluster, "-np", "4", "-H", "hosta:2,hostb:2", "--gloo-timeout-seconds",
                                               "16", sys.executable, "tests/hosts/job_lifetime.py", "train"))
    driver = subprocess.Popen(argv, cwd=cluster.workdir, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    _until_ready(driver, 4)
    cluster.set_link("hostb", up=False)
    try:
        cut = time.monotonic()
        _, stderr = driver.communicate(timeout=120)
        took = time.monotonic() - cut
    finally:
        cluster.set_link("hostb", up=True)  # hostb's processes then see the driver's resets and end
    assert driver.returncode != 0
    first = stderr.split("Also failed")[0]
    assert "host hostb went silent: no heartbeat from its agent" in first, stderr[-3000:]
    assert took < 16 + 10, took  # named within the gloo timeout (12 s of silence), plus the job's teardown
    cluster.wait_clean(30.0)
