"""Object collectives for TensorFlow programs (Horovod's ``horovod.tensorflow.functions``).

Objects travel pickled (cloudpickle) through phalanx.torch's collectives; ``session`` is TensorFlow 1's and is
accepted for compatibility (TensorFlow 2 runs eagerly, so no session is needed). The objects are typed
``Any``: any picklable value, and what comes back is another rank's, of whatever type it sent.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import phalanx.torch as ptorch
from phalanx.tensorflow.ops import broadcast_variables
from phalanx.torch.process_sets import ProcessSet, global_process_set


def broadcast_object(obj: Any, root_rank: int = 0, session: object = None, name: str | None = None,
                     process_set: ProcessSet = global_process_set) -> Any:
    """Send a picklable object from ``root_rank`` to every member of the set.

    Args:
        obj: the object (only the root's value matters).
        root_rank: the global rank that sends.
        session: TensorFlow 1's session; accepted and unused.
        name: optional name for the collectives (default: the object's type name, as in Horovod).
        process_set: the ranks taking part.

    Returns:
        The root's object on every member.
    """
    del session
    return ptorch.broadcast_object(obj, root_rank, name=name or type(obj).__name__, process_set=process_set)


def broadcast_object_fn(root_rank: int = 0, session: object = None, name: str | None = None,
                        process_set: ProcessSet = global_process_set) -> Callable[[Any], Any]:
    """A function ``obj -> root's obj`` (Horovod builds its graph once for TensorFlow 1 sessions)."""
    del session
    prefix = name or "broadcast_object_fn"

    def _bcast(obj: Any) -> Any:
        return ptorch.broadcast_object(obj, root_rank, name=prefix, process_set=process_set)

    return _bcast


def allgather_object(obj: Any, session: object = None, name: str | None = None,
                     process_set: ProcessSet = global_process_set) -> list[Any]:
    """Gather a picklable object from every member; returns the objects in rank order."""
    del session
    return ptorch.allgather_object(obj, name=name or type(obj).__name__, process_set=process_set)


__all__ = ["allgather_object", "broadcast_object", "broadcast_object_fn", "broadcast_variables"]
