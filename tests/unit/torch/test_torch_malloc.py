"""``hvd.init()``'s glibc malloc tuning: freed large blocks are reused without page faults; the knob turns it off."""

from __future__ import annotations

import json
import platform
import subprocess
import sys

import pytest

from phalanx.env import names as env_names

# white-box: the allocator tuning at import, internal (no public name)
from phalanx.torch._setup import malloc as _malloc

# In a fresh process (mallopt is process-wide): page faults of allocating, touching and freeing a 64 MiB
# block, before and after tune() (first with the knob off, which must change nothing).
_PROBE = """
import ctypes, json, resource
from phalanx.torch._setup import malloc as _malloc
libc = ctypes.CDLL(None)
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
SIZE = 64 << 20
def faults():
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(4):
        p = libc.malloc(SIZE)
        ctypes.memset(p, 1, SIZE)
        libc.free(p)
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
default = faults()
off = _malloc.tune({"PHALANX_MALLOC_TUNE": "0"})
after_off = faults()
applied = _malloc.tune({})
faults()  # the first block after tuning is faulted in once
print(json.dumps([default, off, after_off, applied, faults(), _malloc.tune({})]))
"""


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt tuning applies to glibc only")
def test_tuned_malloc_reuses_freed_large_blocks_without_page_faults() -> None:
    out = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, timeout=120, check=True)
    default, off, after_off, applied, tuned, again = json.loads(out.stdout)
    pages = 4 * (64 << 20) // 4096
    assert default >= pages * 0.9, f"glibc's default should fault every fresh 64 MiB block in: {default} faults"
    assert off == {} and after_off >= pages * 0.9, "PHALANX_MALLOC_TUNE=0 must leave glibc's defaults alone"
    assert applied == {"mmap_threshold": _malloc.MMAP_THRESHOLD_BYTES, "trim_threshold": _malloc.TRIM_THRESHOLD_BYTES}
    assert tuned < pages * 0.05, f"after tune() freed blocks should be reused without faults: {tuned} faults"
    assert again == applied  # idempotent


def test_knob_values() -> None:
    assert _malloc.enabled({}) and _malloc.enabled({env_names.PHALANX_MALLOC_TUNE: "1"})
    for off in ("0", "false", "No", " off "):
        assert not _malloc.enabled({env_names.PHALANX_MALLOC_TUNE: off})
