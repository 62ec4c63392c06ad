"""README.md's quickstart, as written: the Python snippets from ``examples/``, the commands from the
repository root with the venv active; nothing may be left in the repository.

Every Python snippet compiles; the ``phalanx.run`` one (complete) runs, and so does the ``horovodrun``
command (the issue's headline: Horovod's launcher name on a fresh clone). The HorovodRunner and
TorchDistributor snippets call the examples' functions (``spark_digits.train_hvd``, ``ddp_train.train``),
which ``test_examples_spark.py`` and ``test_examples_local.py`` run; the ``phalanxrun`` command is
``test_unchanged_horovod_script_under_phalanxrun``'s.
"""

from __future__ import annotations

import ast
import os
import re
import subprocess

import pytest
from example_helpers import EXAMPLES, VENV_BIN

pytestmark = [pytest.mark.multiprocess]

ROOT = EXAMPLES.parent
QUICKSTART = (ROOT / "README.md").read_text().split("## Quickstart")[1].split("\n## ")[0]
BLOCKS = re.findall(r"```(\w*)\n(.*?)```", QUICKSTART, re.S)
PYTHON = [code for lang, code in BLOCKS if lang == "python"]
COMMANDS = [line for lang, code in BLOCKS if not lang for line in code.splitlines() if line.strip()]


def _activated() -> dict[str, str]:
    path = f"{VENV_BIN}{os.pathsep}{os.environ.get('PATH', '')}"
    return dict(os.environ, PATH=path, VIRTUAL_ENV=str(VENV_BIN.parent))


def _visible_entries() -> list[str]:
    """The repository root's entries; dot-entries are tools' caches (another tier's .pytest_cache may appear
    while this test runs), never an example's output."""
    return sorted(p.name for p in ROOT.iterdir() if not p.name.startswith("."))


def test_every_python_snippet_compiles() -> None:
    assert len(PYTHON) >= 5
    for code in PYTHON:
        ast.parse(code)


@pytest.mark.timeout(180)
def test_snippets_run_as_written_and_leave_nothing_in_the_repository() -> None:
    before = _visible_entries()
    run = next(code for code in PYTHON if "phalanx.run(" in code)
    done = subprocess.run(["python", "-c", run], cwd=EXAMPLES, env=_activated(), capture_output=True, text=True,
                          timeout=120, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    accuracies = ast.literal_eval(done.stdout.strip().splitlines()[-1])
    assert len(accuracies) == 2 and min(accuracies) > 0.8, done.stdout
    command = next(line for line in COMMANDS if line.startswith("horovodrun "))
    argv = command.split("#")[0].split()
    done = subprocess.run(argv, cwd=ROOT, env=_activated(), capture_output=True, text=True, timeout=150, check=False)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    assert re.search(r"\[0\]<stdout>:test accuracy: 0\.9", done.stdout), done.stdout[-2000:]
    assert _visible_entries() == before
