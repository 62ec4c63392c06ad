"""Which commands a warm-start template may run (``launch.core.python_command``), and which environment
differences make a forked rank start its command fresh (``worker.pyrun.startup_differs``)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from phalanx.launch.core import python_command
from phalanx.worker.pyrun import startup_differs

BIN = os.path.dirname(sys.executable)


@pytest.mark.parametrize(("command", "kind", "target", "args"), [
    ([sys.executable, "train.py", "--lr", "1"], "path", "train.py", ["--lr", "1"]),
    ([sys.executable, "-u", "train.py"], "path", "train.py", []),
    ([sys.executable, "-m", "pkg.train", "-x"], "module", "pkg.train", ["-x"]),
    (["python", "train.py"], "path", "train.py", []),  # found on PATH: this interpreter's directory
])
def test_this_interpreter_running_a_script_or_module_qualifies(command: list[str], kind: str, target: str,
                                                               args: list[str]) -> None:
    got = python_command(command, BIN, executable=os.path.join(BIN, "python"))
    assert got == {"kind": kind, "target": target, "args": args, "argv": command}


@pytest.mark.parametrize("command", [
    [sys.executable],  # interactive
    [sys.executable, "-c", "print(1)"],
    [sys.executable, "-O", "train.py"],  # an option read at start-up
    [sys.executable, "-m"],
    [sys.executable, "-m", "not a module"],
    ["bash", "train.sh"],
    ["/usr/bin/env", "python", "train.py"],
])
def test_anything_else_starts_fresh(command: list[str]) -> None:
    assert python_command(command, BIN) is None


def test_another_environments_python_starts_fresh(tmp_path: Path) -> None:
    """A virtual environment's python is a link to the same file from another directory: other packages."""
    other = tmp_path / "venv" / "bin"
    other.mkdir(parents=True)
    (other / "python").symlink_to(os.path.realpath(sys.executable))
    assert python_command([str(other / "python"), "train.py"], None) is None
    assert python_command(["python", "train.py"], str(other)) is None


def test_start_up_variables_that_differ_are_named() -> None:
    template = {"PATH": "/bin", "PYTHONPATH": "/a", "LANG": "C.UTF-8", "OMP_NUM_THREADS": "2",
                "PYTHONUNBUFFERED": "1"}
    job = {"PATH": "/usr/bin", "PYTHONPATH": "/a", "LANG": "C.UTF-8", "OMP_NUM_THREADS": "1",
           "PYTHONHASHSEED": "7", "LD_PRELOAD": "x.so", "RANK": "3", "TORCH_FR_BUFFER_SIZE": "2000",
           "TORCH_LOGS": "dynamo"}
    # PATH, RANK: read at run time; OMP_NUM_THREADS: applied after the fork; PYTHONUNBUFFERED: the contract's;
    # TORCH_FR_BUFFER_SIZE: read when a process group is made
    assert startup_differs(template, job) == ["LD_PRELOAD", "PYTHONHASHSEED", "TORCH_LOGS"]
    assert startup_differs(template, {**template, "RANK": "0"}) == []
