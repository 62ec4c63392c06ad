"""The ``phalanx`` command: ``run`` (phalanxrun), ``timeline``, ``doctor``; ``python -m phalanx``."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from phalanx.cli import tool


def test_python_m_phalanx_lists_run_timeline_and_doctor() -> None:
    done = subprocess.run([sys.executable, "-m", "phalanx", "--help"], capture_output=True, text=True, timeout=60,
                          check=False)
    assert done.returncode == 0, done.stderr
    assert all(f"    {name} " in done.stdout for name in ("run", "timeline", "doctor")), done.stdout


def test_run_is_phalanxrun(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        tool.main(["run", "-np", "abc", "python", "x.py"])
    assert info.value.code == 2
    assert capsys.readouterr().err.startswith("phalanx run: error: argument -np/--num-proc: invalid int value")


def test_doctor_names_the_python_of_another_environment_and_its_fix(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "python").write_text("#!/bin/sh\n")
    (tmp_path / "python").chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    assert tool.main(["doctor"]) == 1
    out = capsys.readouterr().out
    for heading in ("versions:", "  torch ", "  pyspark ", "  tensorflow ", "  java ", "transports:",
                    "] gloo:", "default: CPU tensors:", "import horovod: phalanx"):
        assert heading in out, (heading, out)
    assert f"FAIL python on PATH: {tmp_path}/python is not this environment's interpreter" in out
    assert f"fix: activate the environment (. {os.path.dirname(sys.executable)}/activate)" in out

    monkeypatch.setenv("PATH", f"{os.path.dirname(sys.executable)}{os.pathsep}{os.environ['PATH']}")
    tool.main(["doctor"])
    assert "ok   python on PATH" in capsys.readouterr().out
