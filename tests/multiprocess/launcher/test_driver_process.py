"""The driver as a separate process: __main__ functions, Ctrl-C, a killed driver, the phalanxrun CLI."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from tests.waits import wait_gone, wait_until

pytestmark = [pytest.mark.multiprocess]
PHALANXRUN = [sys.executable, "-m", "phalanx.cli.main"]


def _write(tmp_path: Path, name: str, body: str) -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(body))
    return path


WAIT_S = 60.0  # bounds waits that end much sooner (a loaded host); a failure names it


def _wait_for_files(paths: list[Path]) -> None:
    wait_until(lambda: all(p.exists() and p.read_text() for p in paths), WAIT_S, f"the workers wrote {paths}")


@pytest.mark.timeout(90)
def test_function_defined_in_main_runs(tmp_path: Path) -> None:
    script = _write(tmp_path, "driver.py", """
        import phalanx
        def square(x):
            import os
            return x * x + int(os.environ["RANK"])
        if __name__ == "__main__":
            print("RESULT", phalanx.run(square, args=(3,), np=2))
    """)
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=80)
    assert out.returncode == 0, out.stderr
    assert "RESULT [9, 10]" in out.stdout


_SLEEPER = """
    import os, sys, time, phalanx
    def sleeper(d):
        open(os.path.join(d, "pid" + os.environ["RANK"]), "w").write(str(os.getpid()))
        time.sleep(300)  # under test: the ranks run until their driver's end stops them
    if __name__ == "__main__":
        try:
            phalanx.run(sleeper, args=(sys.argv[1],), np=2)
        except KeyboardInterrupt:
            print("INTERRUPTED", flush=True)
            raise SystemExit(130)
"""


@pytest.mark.timeout(90)
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGKILL])
def test_interrupted_or_killed_driver_leaves_no_worker(tmp_path: Path, sig: int) -> None:
    script = _write(tmp_path, "driver.py", _SLEEPER)
    driver = subprocess.Popen([sys.executable, str(script), str(tmp_path)], stdout=subprocess.PIPE, text=True)
    pidfiles = [tmp_path / "pid0", tmp_path / "pid1"]
    _wait_for_files(pidfiles)
    driver.send_signal(sig)
    out, _ = driver.communicate(timeout=30)
    if sig == signal.SIGINT:
        assert driver.returncode == 130 and "INTERRUPTED" in out
    for f in pidfiles:
        wait_gone(int(f.read_text()), WAIT_S, "a worker of the stopped driver")


@pytest.mark.timeout(90)
def test_phalanxrun_runs_a_script_and_returns_the_root_cause_exit_code(tmp_path: Path) -> None:
    script = _write(tmp_path, "train.py", """
        import os, sys, time
        print("rank", os.environ["RANK"], "args", sys.argv[1:])
        if os.environ["RANK"] == "1":
            sys.exit(3)
        time.sleep(60)  # under test: rank 0 runs until rank 1's failure stops it
    """)
    out = subprocess.run([*PHALANXRUN, "-np", "2", "--output-filename", str(tmp_path / "logs"), sys.executable,
                          str(script), "--lr", "0.1"], capture_output=True, text=True, timeout=80)
    assert out.returncode == 3, out.stderr
    assert "[1]<stdout>:rank 1 args ['--lr', '0.1']" in out.stdout
    assert f"rank 1 [on host {socket.gethostname()}] failed: process ended with exit code 3" in out.stderr
    assert (tmp_path / "logs" / "rank.1" / "stdout").read_text() == "rank 1 args ['--lr', '0.1']\n"


@pytest.mark.timeout(90)
def test_phalanxrun_signal_exit_code_and_no_prefix(tmp_path: Path) -> None:
    script = _write(tmp_path, "die.py", """
        import os, signal, sys, time
        print("hi from", os.environ["RANK"], flush=True)
        marker = os.path.join(sys.argv[1], "rank1-spoke")
        if os.environ["RANK"] == "1":
            open(marker, "w").close()
        else:
            deadline = time.monotonic() + 60
            while not os.path.exists(marker):  # rank 1 printed its line before rank 0 dies
                if time.monotonic() > deadline:
                    raise TimeoutError("rank 1's marker did not appear within 60 s")
                time.sleep(0.01)
            os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(60)  # under test: rank 1 runs until rank 0's death stops it
    """)
    out = subprocess.run([*PHALANXRUN, "-np", "2", "--no-prefix", sys.executable, str(script), str(tmp_path)],
                         capture_output=True, text=True, timeout=80)
    assert out.returncode == 128 + signal.SIGTERM
    assert sorted(out.stdout.splitlines()) == ["hi from 0", "hi from 1"]
    assert "signal SIGTERM (15)" in out.stderr


@pytest.mark.timeout(90)
def test_phalanxrun_success_and_missing_script() -> None:
    ok = subprocess.run([*PHALANXRUN, "-np", "2", sys.executable, "-c", "import os; print(os.environ['WORLD_SIZE'])"],
                        capture_output=True, text=True, timeout=80)
    assert ok.returncode == 0 and ok.stdout.count("<stdout>:2") == 2
    missing = subprocess.run([*PHALANXRUN, "-np", "2", sys.executable, "nope.py"], capture_output=True, text=True,
                             timeout=80, cwd=os.path.dirname(__file__))
    assert missing.returncode == 2 and "script 'nope.py' does not exist" in missing.stderr
