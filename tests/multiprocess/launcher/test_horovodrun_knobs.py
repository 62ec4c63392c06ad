"""horovodrun's flags reach real ranks through phalanxrun and act there: one 2-rank job checks the stall
check's warning and shutdown, the log layout and the timestamped output prefix together."""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = [pytest.mark.multiprocess]


@pytest.mark.timeout(120)
def test_stall_shutdown_log_layout_and_timestamp_prefix(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent("""
        import time
        import torch
        import phalanx.torch as hvd
        from phalanx.errors import HorovodInternalError

        hvd.init()
        hvd.allreduce(torch.ones(2), name="warmup")
        if hvd.rank() == 1:
            time.sleep(30)  # rank 0 waits in the allreduce below, past the shutdown time
            raise SystemExit(0)
        try:
            hvd.allreduce(torch.ones(2), name="late")
        except HorovodInternalError as e:
            print("gave up:", e, flush=True)
            raise SystemExit(7)
    """))
    out = subprocess.run(
        [sys.executable, "-m", "phalanx.cli.main", "-np", "2", "--stall-check-warning-time-seconds", "1",
         "--stall-check-shutdown-time-seconds", "3", "--log-level", "WARNING", "--log-without-timestamp",
         "--prefix-output-with-timestamp", sys.executable, str(script)],
        capture_output=True, text=True, timeout=110, check=False)
    assert out.returncode == 7, out.stderr
    stamp = r"\w{3} \w{3} [ \d]\d \d\d:\d\d:\d\d \d{4}"
    # Horovod's stall warning, in Horovod's line layout without the time, once, on the waiting rank.
    warnings = re.findall(rf"^{stamp}\[0\]<stderr>:\[W phalanx\.torch\._health\.stall\] stall check: allreduce 'late' "
                          r"on ranks \[0, 1\] has waited \d+ s", out.stderr, re.M)
    assert len(warnings) == 1, out.stderr
    assert re.search(rf"^{stamp}\[0\]<stdout>:gave up: stall check: allreduce 'late' on ranks \[0, 1\] waited "
                     r"\d+ s, past HOROVOD_STALL_SHUTDOWN_TIME_SECONDS=3", out.stdout, re.M), out.stdout
