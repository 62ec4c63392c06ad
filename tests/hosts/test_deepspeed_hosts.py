"""A DeepSpeed script unchanged across two simulated hosts: phalanxrun --hostfile in DeepSpeed's format
(``host slots=N``), ZeRO 1-3 in one job, one rank per host (gloo between the hosts)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from tests.hosts.simhosts import Cluster

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "multiprocess" / "deepspeed"))
import _zero_job as job

JOBS = Path(job.__file__).parent
pytestmark = [pytest.mark.multiprocess, pytest.mark.hosts, pytest.mark.timeout(240)]


def test_deepspeed_zero_1_2_3_across_hosts_from_a_deepspeed_hostfile(cluster: Cluster, tmp_path: Path) -> None:
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("# DeepSpeed's format\nhosta slots=1\nhostb slots=1\n")
    argv = [sys.executable, "-m", "phalanx.cli.main", "-i", str(cluster.key), "--start-timeout", "60",
            "-np", "2", "--hostfile", str(hostfile), sys.executable, str(JOBS / "_zero_job.py")]
    done = cluster.run_on("hosta", argv, timeout=220, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:] + done.stdout[-3000:]
    got = [json.loads(line.partition("ZERO ")[2]) for line in done.stdout.splitlines() if "ZERO {" in line]
    job.check(got, world=2)
    assert {(r["env"]["LOCAL_RANK"], r["env"]["LOCAL_WORLD_SIZE"]) for r in got} == {("0", "1")}
    cluster.wait_clean(10.0)
