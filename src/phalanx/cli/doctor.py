"""``phalanx doctor``: what this environment has for phalanx, and what to fix before a first job.

It prints the versions that matter (phalanx, Python, torch, pyspark, TensorFlow, Java), the transports a
job can use, what carries a collective by default, and whether ``import horovod`` gives phalanx. Then it
runs the checks a newcomer trips over (the ``python`` that ``phalanxrun ... python train.py`` starts is
another environment's; no Java for Spark; a small ``/dev/shm``...) and prints each failure with its fix.
Nothing here starts a job; every probe has a timeout.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass

from phalanx import __version__
from phalanx.env import settings

_JAVA_TIMEOUT_S = 10.0
_MIN_JAVA = 17
_MIN_SHM_BYTES = 512 << 20


@dataclass(frozen=True)
class Check:
    """One check: what it looked at, whether it passed, and the fix when it did not."""

    name: str
    ok: bool
    detail: str
    fix: str = ""


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def java_version() -> tuple[str | None, str]:
    """(``java -version``'s version, the binary) of ``$JAVA_HOME/bin/java`` or the ``java`` on PATH."""
    home = os.environ.get("JAVA_HOME")
    java = os.path.join(home, "bin", "java") if home else shutil.which("java")
    if not java or not os.path.exists(java):
        return None, java or "java"
    try:
        done = subprocess.run([java, "-version"], capture_output=True, text=True, timeout=_JAVA_TIMEOUT_S,
                              check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None, java
    found = re.search(r'version "([^"]+)"', done.stderr + done.stdout)
    return (found.group(1) if found else None), java


def versions() -> list[tuple[str, str]]:
    """(name, version or 'not installed') of what phalanx works with."""
    out = [("phalanx", __version__), ("python", sys.version.split()[0] + f" ({sys.executable})")]
    for name, package in (("torch", "torch"), ("pyspark", "pyspark"), ("tensorflow", "tensorflow-cpu"),
                          ("lightning", "lightning")):
        found = _version(package) or (_version("tensorflow") if name == "tensorflow" else None)
        out.append((name, found or "not installed"))
    java, where = java_version()
    out.append(("java", f"{java} ({where})" if java else "not found"))
    return out


def transports() -> list[tuple[str, bool, str]]:
    """(transport, available, note) for shared memory, gloo and NCCL."""
    shm = os.access("/dev/shm", os.W_OK)
    gloo = nccl = cuda = False
    if _version("torch"):
        import torch
        import torch.distributed as dist

        gloo, nccl, cuda = dist.is_gloo_available(), dist.is_nccl_available(), torch.cuda.is_available()
    shm_on = settings.SHM.get()
    return [
        ("shared memory (/dev/shm)", shm and shm_on, "ranks of one host" if shm_on else "off: PHALANX_SHM=0"),
        ("gloo", gloo, "CPU tensors across hosts, and everything when shared memory is off"),
        ("NCCL", nccl and cuda, "CUDA tensors" if cuda else "needs a CUDA GPU and torch built with NCCL"),
    ]


def default_backend(shm_usable: bool) -> str:
    """What carries ``hvd.allreduce`` of a CPU tensor in a job started here."""
    if shm_usable:
        return "CPU tensors: shared memory between the ranks of a host, gloo between hosts; CUDA tensors: NCCL"
    return "CPU tensors: gloo; CUDA tensors: NCCL"


def horovod_resolution() -> str:
    """Whether ``import horovod`` gives phalanx's aliases, the real Horovod, or nothing."""
    try:
        module = importlib.import_module("horovod")
    except ImportError:
        return "does not resolve (phalanx's aliases are not installed in this interpreter)"
    if getattr(module, "__phalanx_alias__", False):
        return "phalanx (horovod.torch is phalanx.torch; horovodrun is phalanxrun)"
    return f"the real Horovod {getattr(module, '__version__', '?')} ({getattr(module, '__file__', '?')})"


def _same_environment(path: str | None) -> bool:
    """Whether ``path`` sits in this interpreter's bin directory (a venv's python is a symlink to the base
    interpreter: resolving links would take another environment's python for this one)."""
    here = os.path.dirname(os.path.abspath(sys.executable))
    return path is not None and os.path.dirname(os.path.abspath(path)) == here


def _check_python_on_path() -> Check:
    python = shutil.which("python")
    if _same_environment(python):
        return Check("python on PATH", True, str(python))
    found = python or "no python on PATH"
    return Check("python on PATH", False, f"{found} is not this environment's interpreter ({sys.executable})",
                 f"activate the environment (. {os.path.dirname(sys.executable)}/activate) so that "
                 "'phalanxrun -np 2 python train.py' starts ranks that import phalanx")


def _check_launcher_on_path() -> Check:
    found = shutil.which("phalanxrun")
    ok = _same_environment(found)
    return Check("phalanxrun on PATH", ok, found or "not found",
                 "" if ok else f"activate the environment, or run {os.path.dirname(sys.executable)}/phalanxrun")


def _check_java() -> Check:
    if not _version("pyspark"):
        return Check("Java for Spark", True, "pyspark is not installed (phalanx.spark unused)")
    java, where = java_version()
    major = int(re.split(r"[.+-]", java)[0]) if java and java[0].isdigit() else 0
    major = int(java.split(".")[1]) if java and java.startswith("1.") else major
    ok = major >= _MIN_JAVA
    return Check("Java for Spark", ok, f"{java} ({where})" if java else "no java found",
                 "" if ok else f"install Java {_MIN_JAVA}+ (apt-get install openjdk-{_MIN_JAVA}-jre-headless) "
                               "or point JAVA_HOME at one")


def _check_shm() -> Check:
    try:
        stat = os.statvfs("/dev/shm")
    except OSError as e:
        return Check("/dev/shm", False, str(e), "mount a tmpfs on /dev/shm, or set PHALANX_SHM=0 (gloo only)")
    size = stat.f_frsize * stat.f_blocks
    ok = size >= _MIN_SHM_BYTES and os.access("/dev/shm", os.W_OK)
    return Check("/dev/shm", ok, f"{size >> 20} MiB", "" if ok else
                 "give the container more (docker run --shm-size=2g), or set PHALANX_SHM=0 (gloo only)")


def _check_torch() -> Check:
    version = _version("torch")
    return Check("torch", version is not None, version or "not installed",
                 "" if version else "pip install torch (the CPU build: --index-url "
                                    "https://download.pytorch.org/whl/cpu)")


CHECKS: tuple[Callable[[], Check], ...] = (_check_torch, _check_python_on_path, _check_launcher_on_path,
                                           _check_shm, _check_java)


def report() -> tuple[str, int]:
    """The doctor's text and the number of failed checks."""
    lines = ["versions:"]
    lines += [f"  {name:<11} {value}" for name, value in versions()]
    lines.append("transports:")
    found = transports()
    lines += [f"  [{'X' if ok else ' '}] {name}: {note}" for name, ok, note in found]
    lines.append(f"default: {default_backend(found[0][1])}")
    lines.append(f"import horovod: {horovod_resolution()}")
    lines.append("checks:")
    failed = 0
    for check in (run() for run in CHECKS):
        lines.append(f"  {'ok  ' if check.ok else 'FAIL'} {check.name}: {check.detail}")
        if not check.ok:
            failed += 1
            lines.append(f"       fix: {check.fix}")
    lines.append("all checks passed" if not failed else f"{failed} check(s) failed: see 'fix' above")
    return "\n".join(lines), failed
