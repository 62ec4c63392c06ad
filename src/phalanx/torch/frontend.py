"""What another front end (``phalanx.tensorflow``, its Keras API) builds on besides ``phalanx.torch``'s
Horovod names: the reduce-op codes and their checks, process-set membership, and ``synchronize_shared``
(waiting for a collective from one of several threads that issue collectives at once: TF's graph executor).

The other front ends run on phalanx.torch's engine (one state per process, one collective order), so they
take from it only this module and the public modules of Horovod's API (``phalanx.torch``, ``basics``,
``process_sets``, ``elastic``); tests/unit/test_layers.py holds them to it (``INTERFACE``). The engine's
private modules may then move or change without touching another front end.
"""

from __future__ import annotations

from phalanx.torch._engine.reduce import OP_NAMES, Adasum, Average, Max, Min, Product, Sum, check_op, resolve_op
from phalanx.torch._setup.membership import add_process_set, remove_process_set
from phalanx.torch.async_ops import synchronize_shared

__all__ = [
    "OP_NAMES", "Adasum", "Average", "Max", "Min", "Product", "Sum", "add_process_set", "check_op",
    "remove_process_set", "resolve_op", "synchronize_shared",
]
