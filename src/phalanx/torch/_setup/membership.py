"""Registering process sets on every rank: ``hvd.init(process_sets=...)``, ``add_process_set``,
``remove_process_set`` (Horovod's ``horovod.common.process_sets`` functions).

Registration is collective: the ranks first check, with an ``allgather_object``, that they all ask for the
same sets (``new_group`` with different ranks on different processes would hang or build wrong groups).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch.distributed as dist

from phalanx.env import names as env_names
from phalanx.env import settings
from phalanx.errors import CollectiveMismatchError, InvalidArgumentError
from phalanx.torch._runtime import RUNTIME, Registry
from phalanx.torch._setup import state as _state
from phalanx.torch.functions import allgather_object
from phalanx.torch.process_sets import ProcessSet, _register, global_process_set


def _agree(requested: list[list[int]], what: str) -> None:
    """Check, on every rank, that every rank asked for the same sets (``new_group`` with different ranks
    on different processes would hang or build wrong groups).

    Raises:
        CollectiveMismatchError: the ranks asked for different sets (raised on every rank).
    """
    if dist.get_world_size() == 1:
        return
    seen = allgather_object(requested, name=what, process_set=global_process_set)
    if any(s != seen[0] for s in seen[1:]):
        values = ", ".join(f"rank {r}={s}" for r, s in enumerate(seen))
        raise CollectiveMismatchError(
            f"ranks disagree on {what}: {values}. Every rank (members or not) must pass the same ranks, in "
            "the same order of calls; no process set was registered"
        )


def init_process_sets(process_sets: Sequence[ProcessSet] | None, dynamic: bool = False) -> None:
    """Register the global set and the static sets given to ``hvd.init`` (collective on every rank);
    ``dynamic`` allows sets to be added and removed after init.

    Raises:
        CollectiveMismatchError: ranks passed different static sets.
    """
    RUNTIME.registry = Registry(dynamic=dynamic)
    global_process_set.ranks = list(range(dist.get_world_size()))
    global_process_set.process_set_id = None
    _register(global_process_set)
    if process_sets:
        _agree([list(ps.ranks) for ps in process_sets], "hvd.init(process_sets=...)")
    for ps in process_sets or ():
        _register(ps)


def _dynamic_enabled() -> bool:
    return RUNTIME.registry.dynamic or settings.DYNAMIC_PROCESS_SETS.get()


def add_process_set(process_set: ProcessSet | Sequence[int]) -> ProcessSet:
    """Register a process set after ``init`` (collective: every rank must call it, in the same order).

    Args:
        process_set: a :class:`ProcessSet` or a list of global ranks.

    Returns:
        The registered set (with its ``process_set_id``).

    Raises:
        ValueError: dynamic process sets are not enabled (``hvd.init(process_sets="dynamic")`` or
            ``HOROVOD_DYNAMIC_PROCESS_SETS=1``), the ranks are invalid, or a set with the same ranks (the
            global set included) is already registered (Horovod's duplicate rule; raised on every rank).
        CollectiveMismatchError: ranks passed different sets (a ``RuntimeError``, raised on every rank).
    """
    _state.topology()
    if not _dynamic_enabled():
        raise InvalidArgumentError(
            f"adding a process set after init requires hvd.init(process_sets='dynamic') or "
            f"{env_names.HOROVOD_DYNAMIC_PROCESS_SETS}=1 in the environment of every rank (or pass the set to "
            "hvd.init(process_sets=[...]))"
        )
    ps = process_set if isinstance(process_set, ProcessSet) else ProcessSet(process_set)
    _agree([list(ps.ranks)], "add_process_set")
    _refuse_duplicate(ps)
    return _register(ps)


def _refuse_duplicate(ps: ProcessSet) -> None:
    """Raise when a registered set has ``ps``'s ranks (every rank holds the same registry, so every rank
    raises alike)."""
    for existing in RUNTIME.registry.sets.values():
        if existing.ranks == ps.ranks:
            raise InvalidArgumentError(
                f"Attempted to add a duplicate process set: {ps.ranks} (already registered as {existing}); "
                "use the registered set, or remove it first with hvd.remove_process_set"
            )


def remove_process_set(process_set: ProcessSet) -> bool:
    """Unregister a dynamic process set (every rank must call it).

    Args:
        process_set: a set returned by :func:`add_process_set`.

    Returns:
        True when the set was registered and is now removed; False otherwise (the global set cannot be
        removed).
    """
    _state.topology()
    psid = process_set.process_set_id
    if psid is None or psid == 0 or RUNTIME.registry.sets.get(psid) is not process_set:
        return False
    del RUNTIME.registry.sets[psid]
    process_set.process_set_id = None
    process_set._groups = None
    return True
