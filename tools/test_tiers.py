"""``make test``'s pytest: the test tiers in four pytest processes side by side.

Most tests wait (for Spark's JVMs, for ssh, for a timeout under test) more than they compute, so on 2 cores
several processes finish well before one. They can share the machine because nothing one checks globally is
touched by another:

- **hosts** (tests/hosts): its ranks run in network, UTS and mount namespaces of their own, with a private
  /dev/shm each; its leftover checks look only at its own namespaces and descendants.
- **spark** (tests/spark and the Spark examples): in a mount namespace with a private /dev/shm (a tmpfs
  mounted with the machine's /dev/shm options), because the transport tiers assert that /dev/shm holds no
  phalanx file after their jobs, and Spark's ranks make such files. It alone starts Spark (fixed ports such
  as Connect's). Without the privilege to make that namespace (not root), it runs after the others instead.
- **examples** (the local examples: training jobs under phalanxrun, torchrun-style launchers and
  HorovodRunner on the driver): a private /dev/shm too, for the same reason, and after the others without it.
- **the rest** (unit, multiprocess, the docs' checks), in the foreground, its output live.

Every process's leftover-process check looks only at its own descendants. Arguments are pytest's, given to
every process (``make test PYTEST_ARGS="--durations=40"``); when they name tests (a path or node id), one
pytest runs them as given. A background process's output is held and printed after the foreground's, so none
interleaves; the exit status is the first failing process's. Ctrl-C stops all of them.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import IO

# Longer than a tier ever needs (pytest-timeout bounds each test): a hung tier is killed, not waited on.
TIER_TIMEOUT_S = 2400.0
# pytest's status when ``-k``/``-m`` leave none of a tier's tests: not a failure of the run.
NO_TESTS_SELECTED = 5
SHM = "/dev/shm"


@dataclass(frozen=True)
class Tier:
    name: str
    paths: tuple[str, ...]
    private_shm: bool = False


HOSTS = Tier("hosts", ("tests/hosts",))
# The examples first, as in one pytest over tests/: their module stops its Spark session when it ends.
SPARK = Tier("spark", ("tests/examples/test_examples_spark.py", "tests/spark"), private_shm=True)
EXAMPLES = Tier("examples", ("tests/examples/test_examples_local.py",), private_shm=True)


def names_tests(args: list[str]) -> bool:
    """True when ``args`` select tests by path or node id (a positional argument that exists as a path)."""
    return any(not a.startswith("-") and Path(a.split("::")[0]).exists() for a in args)


def tier_args(tier: Tier, args: list[str]) -> list[str]:
    """``args`` for a background tier's pytest: its own JUnit file next to the one asked for, no cache."""
    own = [f"{a}.{tier.name}.xml" if a.startswith("--junitxml=") else a for a in args]
    return [*tier.paths, "-p", "no:cacheprovider", *own]


def pytest(args: list[str]) -> list[str]:
    return [sys.executable, "-m", "pytest", *args]


def shm_options() -> str:
    """The mount options of this machine's /dev/shm (the last mount there wins), for the private copy."""
    options = "mode=1777"
    with open("/proc/self/mounts") as mounts:
        for line in mounts:
            fields = line.split()
            if len(fields) > 3 and fields[1] == SHM and fields[2] == "tmpfs":
                options = fields[3]
    return options


def can_make_private_shm() -> bool:
    return os.geteuid() == 0 and shutil.which("unshare") is not None and os.path.isdir(SHM)


def in_private_shm(argv: list[str]) -> list[str]:
    """``argv`` run in a mount namespace of its own whose /dev/shm is a fresh tmpfs."""
    mount = f'mount -t tmpfs -o {shm_options()} tmpfs {SHM} && exec "$@"'
    return ["unshare", "--mount", "--propagation", "private", "--", "sh", "-c", mount, "sh", *argv]


def start(tier: Tier, args: list[str], held: IO[bytes]) -> subprocess.Popen[bytes]:
    argv = pytest(tier_args(tier, args))
    if tier.private_shm:
        argv = in_private_shm(argv)
    return subprocess.Popen(argv, stdout=held, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)


def finish(tier: Tier, proc: subprocess.Popen[bytes], held: IO[bytes]) -> int:
    """Wait for a background tier (killed past TIER_TIMEOUT_S), print its held output, return its status."""
    try:
        status = proc.wait(timeout=TIER_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        status = proc.wait()
        print(f"tools/test_tiers.py: the {tier.name} tier ran past TIER_TIMEOUT_S ({TIER_TIMEOUT_S:.0f} s) "
              "and was killed", file=sys.stderr)
    held.seek(0)
    sys.stdout.flush()
    print(f"\n======== {tier.name} tier: {' '.join(tier.paths)} (run side by side) ========", flush=True)
    os.write(sys.stdout.fileno(), held.read())
    return 0 if status == NO_TESTS_SELECTED else status


def run_side_by_side(args: list[str]) -> int:
    """The background tiers started, the rest in the foreground, then each tier's output; the first failure."""
    private = [SPARK, EXAMPLES]
    background = [HOSTS, *private] if can_make_private_shm() else [HOSTS]
    later = [] if can_make_private_shm() else private
    ignored = [flag for t in (HOSTS, *private) for p in t.paths for flag in ("--ignore", p)]
    files = [tempfile.TemporaryFile() for _ in background]
    procs = [start(t, args, f) for t, f in zip(background, files)]
    try:
        statuses = [subprocess.call(pytest([*ignored, *args]))]
        statuses += [finish(t, p, f) for t, p, f in zip(background, procs, files)]
        statuses += [subprocess.call(pytest(tier_args(t, args))) for t in later]
    except KeyboardInterrupt:
        for proc in procs:
            proc.send_signal(signal.SIGINT)
            proc.wait()
        return 130
    finally:
        for f in files:
            f.close()
    return next((s for s in statuses if s not in (0, NO_TESTS_SELECTED)), 0)


def main(argv: list[str]) -> int:
    if names_tests(argv):
        return subprocess.call(pytest(argv))
    return run_side_by_side(argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
