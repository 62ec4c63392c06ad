"""An elastic phalanxrun job across two simulated hosts (3 workers: 2 on host a, 1 on host b): host b dies
mid-training (every process on it is SIGKILLed, as when the machine goes down), the world re-forms on host a
and the job finishes there."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest
from tests.hosts.simhosts import Cluster
from tests.hosts.test_phalanxrun_hosts import phalanxrun, results

pytestmark = [pytest.mark.multiprocess, pytest.mark.hosts, pytest.mark.timeout(180)]

JOB = "tests/hosts/job_elastic.py"
STEPS = 16
KILL_AFTER = 3


def test_elastic_job_loses_host_b_and_finishes_on_host_a(cluster: Cluster) -> None:
    argv = cluster.argv_on("hosta", phalanxrun(cluster, "-np", "3", "-H", "hosta:2,hostb:1", "--min-np", "2",
                                               "--max-np", "3", "-x", "PHALANX_ELASTIC_TIMEOUT_S=30",
                                               sys.executable, JOB, str(STEPS)))
    driver = subprocess.Popen(argv, cwd=cluster.workdir, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert driver.stdout is not None
    seen = []
    for line in driver.stdout:
        seen.append(line)
        if f"STEP {KILL_AFTER} size 3" in line:
            break
    victims = cluster.hosts["hostb"].leftovers()
    assert victims, "".join(seen)[-3000:]
    for pid in victims:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    rest, stderr = driver.communicate(timeout=150)
    stdout = "".join(seen) + rest
    assert driver.returncode == 0, stderr[-3000:] + stdout[-2000:]
    got = results(stdout)
    assert sorted(got) == [0, 1], stdout[-3000:]
    assert all(r["size"] == 2 and r["host"] == "hosta" and r["step"] == STEPS for r in got.values()), got
    # Every committed step counted its world once: 3 before the loss, 2 after, nothing committed twice.
    at_three = got[0]["total"] - 2 * STEPS
    assert at_three == int(at_three) and KILL_AFTER <= at_three < STEPS, got
    assert "size 2" in stdout and "ssh to host hostb failed or dropped" in stderr, stderr[-3000:]
    assert cluster.wait_clean(10.0) == {}
