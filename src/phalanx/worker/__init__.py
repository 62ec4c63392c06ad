"""The worker side of a job: read the contract, fetch the payload, run it, report.

``python -m phalanx.worker`` is the process every launcher starts for a function job;
``python -m phalanx.worker.exec CMD ...`` starts a command rank (it only ties the command's life to the
launcher's, then execs it).
"""

from __future__ import annotations

from typing import Any

__all__ = ["current_channel"]


def __getattr__(name: str) -> Any:
    if name == "current_channel":
        from phalanx.worker.runtime import current_channel

        return current_channel
    raise AttributeError(f"module 'phalanx.worker' has no attribute {name!r}")
