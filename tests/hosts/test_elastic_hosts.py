"""Elastic jobs across two simulated hosts (3 workers: 2 on host a, 1 on host b), in both forms.

- ``phalanxrun`` with no ``-H`` (the ranks start on the discovered hosts): host b dies mid-training (every
  process on it is SIGKILLed, as when the machine goes down); host discovery also lists ``hostc``, a host
  that does not resolve: it is checked before use and left out with one warning, never given a worker. The
  world re-forms on host a and the job finishes there.
- ``phalanx.run(fn, hosts=..., min_np=...)``: host discovery stops listing host b while the ranks wait after
  a commit; host b's worker is stopped (nothing is left there), the survivors meet the new world as
  ``HostsUpdatedInterrupt`` (Horovod's way), the world re-forms on host a and ``phalanx.run`` returns the final
  world's values.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
from tests.hosts.simhosts import Cluster
from tests.hosts.test_phalanxrun_hosts import phalanxrun, results
from tests.waits import wait_until

pytestmark = [pytest.mark.multiprocess, pytest.mark.hosts, pytest.mark.timeout(180)]

JOB = "tests/hosts/job_elastic.py"
STEPS = 16
CHANGE_AFTER = 3


def discovery(tmp_path: Path, hosts: str) -> tuple[Path, Path]:
    """A host discovery script printing the ``host:slots`` lines of a file; (script, file)."""
    listing, script = tmp_path / "hosts.txt", tmp_path / "discover.sh"
    listing.write_text(hosts)
    script.write_text(f"#!/bin/sh\ncat {listing}\n")
    script.chmod(0o755)
    return script, listing


def until(driver: subprocess.Popen[str], marker: str) -> list[str]:
    """The driver's output lines up to the first holding ``marker``."""
    assert driver.stdout is not None
    seen = []
    for line in driver.stdout:
        seen.append(line)
        if marker in line:
            break
    return seen


def check_finished_on_host_a(got: dict[int, dict[str, Any]], stdout: str) -> None:
    """Ranks 0 and 1 finished on host a; every committed step counted its world once (3 before the loss, 2
    after, nothing committed twice)."""
    assert sorted(got) == [0, 1], stdout[-3000:]
    assert all(r["size"] == 2 and r["host"] == "hosta" and r["step"] == STEPS for r in got.values()), got
    at_three = got[0]["total"] - 2 * STEPS
    assert at_three == int(at_three) and CHANGE_AFTER <= at_three < STEPS, got


def test_script_job_loses_host_b_and_skips_a_bad_joining_host(cluster: Cluster, tmp_path: Path) -> None:
    script, _ = discovery(tmp_path, "hosta:2\nhostb:1\nhostc:1\n")
    gate = tmp_path / "gate"
    # Horovod's usual elastic command: no -H, the ranks start on the hosts discovery lists (issue 32,
    # item 11: they all went to this machine).
    argv = cluster.argv_on("hosta", phalanxrun(cluster, "-np", "3", "--min-np", "2",
                                               "--max-np", "4", "--host-discovery-script", str(script),
                                               "-x", "PHALANX_ELASTIC_TIMEOUT_S=30", sys.executable, JOB,
                                               str(STEPS), str(CHANGE_AFTER), str(gate)))
    driver = subprocess.Popen(argv, cwd=cluster.workdir, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    errors: list[str] = []
    reader = threading.Thread(target=lambda: errors.extend(driver.stderr or ()), daemon=True)
    reader.start()
    seen = until(driver, f"STEP {CHANGE_AFTER} size 3")  # the 3 ranks wait at the gate
    victims = cluster.hosts["hostb"].leftovers()
    assert victims, "".join(seen)[-3000:]
    for pid in victims:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    # The driver has checked host c (discovery lists it from the start) while the job still runs.
    wait_until(lambda: any("left out a host" in line for line in errors), 60, "the driver left out host c")
    gate.touch()
    assert driver.stdout is not None
    rest = driver.stdout.read()  # to the driver's end (the test's timeout bounds it)
    driver.wait(30)
    reader.join(30)
    stdout, stderr = "".join(seen) + rest, "".join(errors)
    assert driver.returncode == 0, stderr[-3000:] + stdout[-2000:]
    check_finished_on_host_a(results(stdout), stdout)
    assert "size 2" in stdout and "ssh to host hostb failed or dropped" in stderr, stderr[-3000:]
    # hostc was checked and left out with one line naming it and the cause; no worker ever went there.
    left_out = [line for line in stderr.splitlines() if "left out a host that host discovery added" in line]
    assert len(left_out) == 1 and "host 'hostc': ssh could not connect" in left_out[0], stderr[-3000:]
    assert "resolve hostname hostc" in left_out[0], left_out
    assert "size 4" not in stdout and "host hostc failed" not in stderr and "on host hostc" not in stderr
    cluster.wait_clean(10.0)


def test_function_job_stops_the_ranks_of_a_host_that_leaves_discovery(cluster: Cluster, tmp_path: Path) -> None:
    script, listing = discovery(tmp_path, "hosta:2\nhostb:1\n")
    argv = cluster.argv_on("hosta", [sys.executable, JOB, str(STEPS), str(cluster.key), str(script),
                                     str(CHANGE_AFTER)])
    driver = subprocess.Popen(argv, cwd=cluster.workdir, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    seen = until(driver, f"STEP {CHANGE_AFTER} size 3")
    assert cluster.hosts["hostb"].leftovers(), "".join(seen)[-3000:]
    (tmp_path / "next.txt").write_text("hosta:2\n")
    (tmp_path / "next.txt").rename(listing)
    seen += until(driver, "size 2")
    # Host b's rank, its agent and its ssh session end once the world re-formed without it.
    wait_until(lambda: not cluster.hosts["hostb"].leftovers(), 10.0,
               f"host b's processes ended; the driver's output: {''.join(seen)[-3000:]}")
    rest, stderr = driver.communicate(timeout=150)
    stdout = "".join(seen) + rest
    assert driver.returncode == 0, stderr[-3000:] + stdout[-2000:]
    returned = [line for line in stdout.splitlines() if line.startswith("RESULT ")]
    assert len(returned) == 1, stdout[-3000:]
    values = json.loads(returned[0].removeprefix("RESULT "))
    assert [v["rank"] for v in values] == [0, 1], values  # the final world's values, in rank order
    check_finished_on_host_a({v["rank"]: v for v in values}, stdout)
    assert "stopping worker 2 on host hostb" in stderr, stderr[-3000:]
    # The survivors were waiting, not reducing: they met the new world at check_host_updates(), rolled nothing
    # back, and no collective failed.
    assert "collective failed" not in stdout + stderr and "HorovodInternalError" not in stdout + stderr, stderr[-3000:]
    assert values[0]["total"] == 3 * CHANGE_AFTER + 2 * (STEPS - CHANGE_AFTER), values
    cluster.wait_clean(10.0)
