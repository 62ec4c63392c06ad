"""``make gpu-check``'s checks run on CPU (gloo, tiny sizes, 2 ranks), so that a GPU machine never meets a broken
check for the first time: the collectives (every op, bf16/fp32, two process sets) and TorchDistributor's local
mode (the hang report's own test is tests/multiprocess/torch/test_hang_report.py; ``python tools/gpu_check.py
selftest`` runs every row)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

pytestmark = [pytest.mark.multiprocess]
TOOLS = Path(__file__).resolve().parents[3] / "tools"


@pytest.fixture(scope="module")
def gpu_check() -> Any:
    sys.path.insert(0, str(TOOLS))  # the ranks import the tool's functions by name, as the driver does
    import gpu_check as tool

    yield tool
    sys.path.remove(str(TOOLS))


@pytest.mark.timeout(300)
def test_the_matrix_runs_on_cpu(gpu_check: Any) -> None:
    checks = (gpu_check.check_collectives, gpu_check.check_keras, gpu_check.check_distributor)
    rows = gpu_check.matrix(gpu_check.SELFTEST_PLAN, checks)
    assert [r.check for r in rows] == ["collectives", "Keras", "TorchDistributor"]
    assert [r.result for r in rows if not r.result.startswith("skipped")] == ["ok"] * 2, gpu_check.table(rows)
