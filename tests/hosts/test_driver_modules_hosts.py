"""Driver-local modules reach the other host, as on Spark: a directory that exists only on host a (a tmpfs
mounted in host a's mount namespace; host b sees the empty mount point) holds a helper module, a driver
script calling ``phalanx.run(fn, hosts=...)`` and a script run by ``phalanxrun -H``; both import the
helper on host b."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from tests.hosts.simhosts import Cluster
from tests.hosts.test_phalanxrun_hosts import phalanxrun

pytestmark = [pytest.mark.multiprocess, pytest.mark.hosts, pytest.mark.timeout(180)]

HELPER = "VALUE = 'from the driver only'\n\ndef double(x):\n    return 2 * x\n"
DRIVER = """import json, socket, sys
import phalanx
import phx_helper

def fn():
    import phx_helper as h
    return [socket.gethostname(), h.VALUE, phx_helper.double(21)]

out = phalanx.run(fn, np=2, hosts="hosta:1,hostb:1", ssh_identity_file=sys.argv[1], start_timeout=60)
print("RESULT " + json.dumps(out), flush=True)
"""
SCRIPT = """import json, socket
import phx_helper
print("RESULT " + json.dumps([socket.gethostname(), phx_helper.VALUE, phx_helper.double(4)]), flush=True)
"""


@pytest.fixture
def driver_dir(cluster: Cluster) -> Iterator[Path]:
    """A directory whose files exist only in host a's mount namespace."""
    path = Path(f"/tmp/phx{os.getpid()}-driver")
    path.mkdir(exist_ok=True)
    sshd = cluster.hosts["hosta"].sshd.pid
    subprocess.run(["nsenter", "-t", str(sshd), "-m", "mount", "-t", "tmpfs", "tmpfs", str(path)], check=True,
                   timeout=30)
    inside = Path(f"/proc/{sshd}/root") / path.relative_to("/")
    try:
        for name, text in (("phx_helper.py", HELPER), ("driver.py", DRIVER), ("script.py", SCRIPT)):
            (inside / name).write_text(text)
        assert not (path / "phx_helper.py").exists()  # not on host b (nor here)
        yield path
    finally:
        subprocess.run(["nsenter", "-t", str(sshd), "-m", "umount", str(path)], check=False, timeout=30)
        path.rmdir()


def in_dir(path: Path, argv: list[str]) -> list[str]:
    """``argv`` run in ``path`` as host a sees it (nsenter's ``--wd`` would open the directory outside host a's
    mount namespace: the empty mount point)."""
    return ["sh", "-c", f'cd {path} && exec "$@"', "sh", *argv]


def _result_lines(stdout: str) -> list[object]:
    return [json.loads(line.partition("RESULT ")[2]) for line in stdout.splitlines() if "RESULT " in line]


def test_driver_local_modules_reach_the_other_host(cluster: Cluster, driver_dir: Path) -> None:
    done = cluster.run_on("hosta", in_dir(driver_dir, [sys.executable, "driver.py", str(cluster.key)]), timeout=150)
    assert done.returncode == 0, done.stderr[-3000:] + done.stdout[-2000:]
    assert _result_lines(done.stdout)[-1] == [["hosta", "from the driver only", 42],
                                              ["hostb", "from the driver only", 42]]
    done = cluster.run_on("hosta", in_dir(driver_dir, phalanxrun(cluster, "-np", "2", "-H", "hosta:1,hostb:1",
                                                                 sys.executable, "script.py")), timeout=150)
    assert done.returncode == 0, done.stderr[-3000:] + done.stdout[-2000:]
    assert sorted(map(tuple, _result_lines(done.stdout))) == [  # type: ignore[arg-type]
        ("hosta", "from the driver only", 8), ("hostb", "from the driver only", 8)]
    cluster.wait_clean(10.0)
