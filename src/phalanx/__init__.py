"""phalanx: distributed deep-learning training for Python.

``phalanx.run(fn, np=N)`` runs a function on N local processes; ``phalanx.torch`` is the Horovod API on
``torch.distributed``; ``phalanx.spark`` launches on Apache Spark. Submodules are imported lazily so that
``import phalanx`` stays cheap and never pulls in torch or pyspark.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"
#: The Horovod release whose API phalanx implements (``horovod.__version__`` under the alias).
HOROVOD_API_VERSION = "0.28.1"

if TYPE_CHECKING:
    from phalanx.launch.api import run

__all__ = ["HOROVOD_API_VERSION", "__version__", "run"]


def __getattr__(name: str) -> Any:
    if name == "run":
        from phalanx.launch.api import run

        return run
    raise AttributeError(f"module 'phalanx' has no attribute {name!r}")
