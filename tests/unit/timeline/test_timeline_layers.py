"""phalanx.timeline imports only the standard library, phalanx.env and phalanx.errors (and never torch)."""

from __future__ import annotations

import subprocess
import sys


def test_timeline_imports_no_torch_and_no_other_layer() -> None:
    # Modules loaded at start-up (site, .pth files such as the compat aliases) are not the timeline's doing.
    code = (
        "import sys\n"
        "before = set(sys.modules)\n"
        "import phalanx.timeline, phalanx.timeline.summary, phalanx.timeline.plot, phalanx.cli.tool\n"
        "new = sorted(m for m in set(sys.modules) - before if m.startswith('phalanx.') or m == 'torch')\n"
        "print(' '.join(new))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    allowed = ("phalanx.timeline", "phalanx.env", "phalanx.errors", "phalanx.cli")
    assert "torch" not in out
    assert "phalanx.timeline.writer" in out
    assert [m for m in out if not m.startswith(allowed)] == []
