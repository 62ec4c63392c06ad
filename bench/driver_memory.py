"""The driver's peak memory while ranks flood it: one huge line, many short lines, large results.

Each scenario runs in a fresh driver process (a process's peak RSS only grows), and the figure printed
is that driver's peak RSS minus the peak of a driver that ran an empty job of the same shape. The ranks'
output goes to the driver's console (here /dev/null). No competitor runs: torchrun's agent does not read
the ranks' output or return values at all.

    .venv/bin/python bench/driver_memory.py
"""

from __future__ import annotations

import subprocess
import sys

SCENARIOS = {
    "empty job (baseline)": "lambda: None",
    "one 50 MB line": "lambda: print('x' * (50 << 20))",
    "500k short lines": "lambda: [print(f'line {i}') for i in range(500_000)] and None",
    "two 200 MB results": "lambda: bytes(200 << 20)",
}

DRIVER = """
import resource, sys
import phalanx
fn = {fn}
phalanx.run(fn, np=2, start_timeout=300)
print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, file=sys.stderr)
"""


def peak_mib(fn: str) -> float:
    """The peak RSS (MiB) of a fresh driver that ran ``fn`` on 2 ranks."""
    done = subprocess.run([sys.executable, "-c", DRIVER.format(fn=fn)], stdout=subprocess.DEVNULL,
                          stderr=subprocess.PIPE, text=True, check=True, timeout=900)
    return int(done.stderr.strip().splitlines()[-1]) / 1024


def main() -> int:
    base = peak_mib(SCENARIOS["empty job (baseline)"])
    print(f"driver peak RSS, empty 2-rank job: {base:.0f} MiB")
    for name, fn in SCENARIOS.items():
        if fn == SCENARIOS["empty job (baseline)"]:
            continue
        print(f"{name:>20}: driver peak +{peak_mib(fn) - base:.0f} MiB over the empty job")
    return 0


if __name__ == "__main__":
    sys.exit(main())
