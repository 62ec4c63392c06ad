"""``phalanxrun --check-build`` and ``--version``: what this installation of phalanx supports.

The report has horovodrun's layout (frameworks, controllers, tensor operations, ``[X]`` for available) so
that scripts reading ``horovodrun --check-build`` read it too; the header names phalanx's version and the
Horovod API version it implements. Availability is probed, never assumed: a framework counts when its
package can be imported here, NCCL when torch was built with it.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass

from phalanx import HOROVOD_API_VERSION, __version__


@dataclass(frozen=True)
class BuildInfo:
    """What phalanx can use in this environment."""

    tensorflow: bool
    torch: bool
    gloo: bool
    nccl: bool
    spark: bool


def version_text() -> str:
    """``phalanxrun --version``: phalanx's version and the Horovod API version it implements."""
    return f"phalanx {__version__} (Horovod API {HOROVOD_API_VERSION})"


def _importable(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def probe() -> BuildInfo:
    """Look at this environment (imports torch when it is installed, to ask which backends it has)."""
    has_torch = _importable("torch")
    gloo = nccl = False
    if has_torch:
        import torch.distributed as dist

        gloo, nccl = dist.is_gloo_available(), dist.is_nccl_available()
    return BuildInfo(tensorflow=_importable("tensorflow"), torch=has_torch, gloo=gloo, nccl=nccl,
                     spark=_importable("pyspark"))


def report(info: BuildInfo) -> str:
    """The ``--check-build`` text for ``info``."""

    def mark(value: bool) -> str:
        return "X" if value else " "

    return "\n".join([
        f"phalanx v{__version__} (Horovod API v{HOROVOD_API_VERSION}):",
        "",
        "Available Frameworks:",
        f"    [{mark(info.tensorflow)}] TensorFlow",
        f"    [{mark(info.torch)}] PyTorch",
        "    [ ] MXNet",
        f"    [{mark(info.spark)}] Spark (phalanx.spark)",
        "",
        "Available Controllers:",
        "    [ ] MPI",
        f"    [{mark(info.gloo)}] Gloo",
        "",
        "Available Tensor Operations:",
        f"    [{mark(info.nccl)}] NCCL",
        "    [ ] DDL",
        "    [ ] CCL",
        "    [ ] MPI",
        f"    [{mark(info.gloo)}] Gloo",
        f"    [{mark(info.torch)}] shared memory (same-host ranks)",
        "",
    ])
