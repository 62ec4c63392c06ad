"""phalanx.timeline imports only the standard library, phalanx.env.names and phalanx.errors."""

from __future__ import annotations

import subprocess
import sys


def test_timeline_imports_no_torch_and_no_other_layer() -> None:
    code = (
        "import sys, phalanx.timeline, phalanx.timeline.summary, phalanx.timeline.plot, phalanx.cli.tool\n"
        "mods = sorted(m for m in sys.modules if m.startswith('phalanx.') or m == 'torch')\n"
        "print(' '.join(mods))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    allowed = ("phalanx.timeline", "phalanx.env", "phalanx.errors", "phalanx.cli")
    assert "torch" not in out
    assert [m for m in out if not m.startswith(allowed)] == []
