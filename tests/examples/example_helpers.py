"""Helpers for running the examples: the ``examples/`` directory on ``sys.path`` (as when a user runs a
script from it), each example's module loaded by path, and a script run under ``phalanxrun``."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path
from types import ModuleType

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = REPO / "examples"
VENV_BIN = Path(sys.executable).parent


def load_example(name: str) -> ModuleType:
    """Import ``examples/<name>.py`` as the module ``name`` (the examples import each other by name)."""
    if str(EXAMPLES) not in sys.path:
        sys.path.insert(0, str(EXAMPLES))
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def phalanxrun(script: str, *args: str, cwd: Path, timeout: float,
               env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """``phalanxrun -np 2 python examples/<script> ARGS`` in ``cwd``, the venv's bin first on PATH (activated)
    and ``env`` over this process's environment; asserts that it exits 0 and returns the finished process."""
    full = dict(os.environ, PATH=f"{VENV_BIN}{os.pathsep}{os.environ.get('PATH', '')}", **(env or {}))
    proc = subprocess.run([str(VENV_BIN / "phalanxrun"), "-np", "2", "python", str(EXAMPLES / script), *args],
                          cwd=cwd, env=full, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def rank0_line(stdout: str, pattern: str) -> re.Match[str]:
    """The match of ``pattern`` in rank 0's prefixed output (``[0]<stdout>:...``); fails with the output's
    tail when rank 0 printed no such line."""
    found = re.search(r"\[0\]<stdout>:" + pattern, stdout)
    assert found is not None, stdout[-3000:]
    return found
