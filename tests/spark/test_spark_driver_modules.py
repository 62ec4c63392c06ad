"""A driver script whose function imports modules that sit next to it, on an embedded Spark.

Runs a real driver process (``python driver.py`` from another working directory), so the embedded
``local[*]`` default, the executors' interpreter and the module shipping are all exercised as a user
meets them. Neither the script's directory nor the working directory holds the modules the executors
need: they must travel with the job.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.spark]

DRIVER = """
import os, sys
from phalanx.spark import HorovodRunner, log_to_driver
import pkgmod.inner as inner          # imported on the driver: the function references it

def main(factor):
    import helper                      # imported only inside the function, never on the driver
    log_to_driver(f"rank {os.environ['RANK']} imported helper from {os.path.dirname(helper.__file__)}")
    return {"value": helper.scale(inner.VALUE) * factor, "python": sys.executable,
            "script_dir_on_path": os.path.dirname(os.path.abspath(__file__)) in sys.path}

if __name__ == "__main__":
    print("RESULT", HorovodRunner(np=2).run(main, factor=2), flush=True)
"""


@pytest.mark.timeout(240)
def test_modules_next_to_the_driver_script_work_on_the_executors(tmp_path: Path) -> None:
    project = tmp_path / "project"
    (project / "pkgmod").mkdir(parents=True)
    (project / "driver.py").write_text(DRIVER)
    (project / "helper.py").write_text("def scale(x):\n    return x * 3\n")
    (project / "pkgmod" / "__init__.py").write_text("")
    (project / "pkgmod" / "inner.py").write_text("VALUE = 7\n")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("PYSPARK_PYTHON", "PYTHONPATH")}
    proc = subprocess.run([sys.executable, str(project / "driver.py")], cwd=elsewhere, env=env,
                          capture_output=True, text=True, timeout=200)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert result, proc.stdout
    assert "'value': 42" in result[0] and f"'python': '{sys.executable}'" in result[0]
    assert "'script_dir_on_path': False" in result[0]  # the modules were shipped, not found on a path
    assert "[1]<stdout>:rank 1 imported helper from" in proc.stdout
    assert str(project) not in proc.stdout.split("imported helper from", 1)[1].splitlines()[0]
