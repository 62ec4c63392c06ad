"""``phalanxrun python SCRIPT`` / ``python -m MODULE``: ranks forked from a warm-start template that imported
torch once, each running the script as a fresh interpreter would (``phalanx.worker.pyrun``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

pytestmark = [pytest.mark.multiprocess]
PHALANXRUN = [sys.executable, "-m", "phalanx.cli.main"]

SCRIPT = """
import sys
preloaded = "torch" in sys.modules  # before this script imports anything: forked from the template
import atexit, json, os, random, signal, threading, time
import numpy as np
import torch
import torch.distributed as dist

out = sys.argv[1]
rank = os.environ["RANK"]
dist.init_process_group("gloo")  # through phalanx's store and the phalanx_shm substitution, as when cold
total = torch.ones(1)
dist.all_reduce(total)
info = {
    "allreduce": float(total), "backend": str(dist.get_backend()),
    "preloaded": preloaded, "ppid": os.getppid(), "name": __name__, "file": __file__, "argv": sys.argv,
    "path0": sys.path[0], "spec": __spec__ is None, "main": sys.modules["__main__"].__dict__ is globals(),
    "draws": [random.random(), float(torch.rand(1)), float(np.random.rand())],
    "signals": [signal.getsignal(signal.SIGINT) is signal.default_int_handler,
                signal.getsignal(signal.SIGTERM) == signal.SIG_DFL],
    "env": os.environ.get("PHALANX_TEST_VAR"),
}
with open(os.path.join(out, f"info{rank}.json"), "w") as f:
    json.dump(info, f)

def late():
    time.sleep(0.2)  # under test: this thread outlives the script's last line, and the exit must join it
    open(os.path.join(out, f"thread{rank}"), "w").close()

threading.Thread(target=late).start()  # not a daemon: the exit joins it
atexit.register(lambda: open(os.path.join(out, f"atexit{rank}"), "w").close())
dist.destroy_process_group()
if rank == "2":
    deadline = time.monotonic() + 60
    while not all(os.path.exists(os.path.join(out, f"atexit{r}")) for r in "01"):  # the others ended
        if time.monotonic() > deadline:
            raise TimeoutError("ranks 0 and 1 did not run their atexit hooks within 60 s")
        time.sleep(0.05)

    def inner():
        raise ValueError("rank 2 fails on purpose")
    inner()
"""


def _job(tmp_path: Path, name: str, command: list[str], *flags: str,
         env: dict[str, str] | None = None) -> tuple[subprocess.CompletedProcess[str], Path]:
    out = tmp_path / name
    out.mkdir()
    # a start timeout that outlasts the template's imports on a loaded host (else the ranks start cold)
    done = subprocess.run([*PHALANXRUN, "--start-timeout", "150", *flags, *command, str(out)], capture_output=True,
                          text=True, timeout=200,
                          cwd=tmp_path, env={**os.environ, "PHALANX_TEST_VAR": "job", **(env or {})})
    return done, out


def _infos(out: Path, n: int) -> list[dict[str, Any]]:
    return [json.loads((out / f"info{r}.json").read_text()) for r in range(n)]


@pytest.mark.timeout(420)
def test_a_script_runs_in_forked_ranks_as_in_fresh_interpreters(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(SCRIPT))
    command = [sys.executable, str(script)]
    forked, fout = _job(tmp_path, "forked", command, "-np", "3")
    cold, cout = _job(tmp_path, "cold", command, "-q", "-np", "3", env={"PHALANX_WARM_START": "0"})
    assert not [ln for ln in cold.stderr.splitlines() if ln.startswith("phalanx: ")], cold.stderr  # -q: no progress
    for done, out in ((forked, fout), (cold, cout)):
        assert done.returncode == 1, done.stderr
        # the interpreter's report of the uncaught exception, from the script's own frame
        lines = [line.split(":", 1)[1].removeprefix("[rank2]: ")  # torch's excepthook names the rank
                 for line in done.stdout.splitlines() + done.stderr.splitlines() if line.startswith("[2]<stderr>:")]
        assert "Traceback (most recent call last):" in lines, done.stdout + done.stderr
        tb = lines.index("Traceback (most recent call last):")
        assert lines[tb + 1].startswith(f'  File "{script}", line ') and "runpy" not in "".join(lines)
        assert "ValueError: rank 2 fails on purpose" in lines
        for r in range(3):  # non-daemon threads joined, atexit hooks run, also on the failing rank
            assert (out / f"thread{r}").exists() and (out / f"atexit{r}").exists()
    f, c = _infos(fout, 3), _infos(cout, 3)
    assert [i["preloaded"] for i in f] == [True] * 3 and [i["preloaded"] for i in c] == [False] * 3
    assert len({i["ppid"] for i in f}) == 1 and f[0]["ppid"] != c[0]["ppid"]  # one template
    same = ("name", "file", "spec", "main", "signals", "env", "path0", "allreduce", "backend")
    assert [{k: i[k] for k in same} for i in f] == [{k: i[k] for k in same} for i in c]
    assert f[0]["name"] == "__main__" and f[0]["main"] and f[0]["env"] == "job" and f[0]["allreduce"] == 3.0
    assert f[0]["path0"] == str(tmp_path.resolve())
    assert [i["argv"] for i in f] == [[str(script), str(fout)]] * 3
    for k in range(3):  # Python's, torch's and numpy's generators draw differently in every rank
        assert len({i["draws"][k] for i in f}) == 3


@pytest.mark.timeout(240)
def test_a_module_runs_forked_as_python_dash_m_runs_it(tmp_path: Path) -> None:
    (tmp_path / "trainmod.py").write_text(textwrap.dedent(SCRIPT).replace('if rank == "2":', "if False:"))
    forked, out = _job(tmp_path, "forked", [sys.executable, "-m", "trainmod"], "-np", "2")
    assert forked.returncode == 0, forked.stderr
    # What the start waited for, in order, as plain lines (stderr is not a terminal): the template, the ranks.
    steps = [ln for ln in forked.stderr.splitlines() if ln.startswith("phalanx: ")]
    assert steps == ["phalanx: waiting for the warm-start template to import torch (once, for all 2 ranks)",
                     "phalanx: ranks started 2/2"], forked.stderr
    for i in _infos(out, 2):
        assert i["preloaded"] and i["name"] == "__main__" and i["main"]
        assert i["file"] == str(tmp_path / "trainmod.py") and i["argv"] == [i["file"], str(out)]
        assert i["path0"] == str(tmp_path)
