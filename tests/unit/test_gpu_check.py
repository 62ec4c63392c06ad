"""``make gpu-check``'s CPU side: GPU detection with a fake ``nvidia-smi``, and its table
(tests/multiprocess/launcher/test_gpu_check_matrix.py runs the matrix's checks on CPU)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any

import pytest

TOOL = Path(__file__).resolve().parents[2] / "tools" / "gpu_check.py"


def load_tool() -> Any:
    """tools/gpu_check.py as the module ``gpu_check``, its directory on ``sys.path`` (the ranks import its
    functions by name, as they would the driver script's)."""
    sys.path.insert(0, str(TOOL.parent))
    spec = importlib.util.spec_from_file_location("gpu_check", TOOL)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_check"] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def gpu_check() -> Any:
    yield load_tool()
    sys.path.remove(str(TOOL.parent))


def _fake_smi(tmp_path: Path, body: str) -> str:
    smi = tmp_path / "nvidia-smi"
    smi.write_text(f"#!/bin/sh\n{body}\n")
    smi.chmod(0o755)
    return str(tmp_path)


def test_detect_says_in_one_line_when_there_is_no_gpu(gpu_check: Any, tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    assert gpu_check.detect() == "gpu-check: no CUDA GPU on this machine (nvidia-smi not found); nothing to check"
    monkeypatch.setenv("PATH", _fake_smi(tmp_path, "echo 'No devices were found'; exit 6"))
    assert "nvidia-smi -L lists none, exit 6" in gpu_check.detect()
    monkeypatch.setenv("PATH", _fake_smi(tmp_path, "echo 'GPU 0: NVIDIA A100-SXM4-80GB (UUID: GPU-1)'"))
    assert gpu_check.detect() is None
    assert gpu_check.main(["detect"]) == 0


def test_the_table_is_one_aligned_block(gpu_check: Any) -> None:
    rows = [gpu_check.Row("collectives", "6 ops", "ok", "48 calls"), gpu_check.Row("Keras", "", "skipped: no GPU")]
    lines = gpu_check.table(rows).splitlines()
    assert lines[0].split() == ["check", "setting", "result", "figure"] and set(lines[1]) <= {"-", " "}
    assert lines[2].index("ok") == lines[0].index("result") == lines[3].index("skipped")
