"""Process sets: named subsets of ranks that run collectives among themselves (Horovod's ``ProcessSet``).

Each distinct membership gets three ``torch.distributed`` groups: a gloo *control* group that carries the
fixed-size signature blocks (see ``_header``), a *data* group (gloo for CPU, NCCL for CUDA tensors) that
carries payloads, and a *grad* group for the ``DistributedOptimizer``'s buckets (so that an explicit
collective issued between ``backward()`` and ``step()`` can never interleave differently with them).
Process sets with the same members share their groups, so that two ranks naming
different sets with the same members are caught by the signature check instead of hanging.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from phalanx.env import names as N
from phalanx.torch import _state
from phalanx.transport import api as shm


@dataclass
class _Groups:
    ctrl: Any
    data: Any
    grad: Any  # the DistributedOptimizer's buckets: their order never interleaves with explicit collectives
    ranks: tuple[int, ...]
    shm: bool = False  # CPU payloads travel through shared memory (grad: deferred to wait(), see transport._dispatch)


class ProcessSet:
    """A subset of ranks that runs collectives together.

    Args:
        ranks_or_comm: the global ranks of the set (any order; duplicates are an error). An MPI
            communicator is not supported (phalanx does not use MPI).

    Attributes:
        process_set_id: the id assigned when the set is registered (``None`` before).
        ranks: the sorted global ranks of the set.
    """

    def __init__(self, ranks_or_comm: Sequence[int]) -> None:
        if not isinstance(ranks_or_comm, Sequence | range):
            raise ValueError(
                f"ProcessSet takes a list of global ranks, got {type(ranks_or_comm).__name__}; "
                "MPI communicators are not supported by phalanx"
            )
        ranks = sorted(int(r) for r in ranks_or_comm)
        if len(set(ranks)) != len(ranks):
            raise ValueError(f"ProcessSet ranks must be distinct, got {list(ranks_or_comm)}")
        self.ranks: list[int] = ranks
        self.process_set_id: int | None = None
        self._groups: _Groups | None = None

    def _require(self) -> _Groups:
        _state.topology()
        if self.process_set_id is None or self._groups is None:
            raise ValueError(
                f"process set {self.ranks} is not registered: pass it to hvd.init(process_sets=[...]) "
                "or hvd.add_process_set(...) on every rank first"
            )
        return self._groups

    def size(self) -> int:
        """Number of ranks in the set."""
        return len(self._require().ranks)

    def rank(self) -> int:
        """This process's rank within the set, or -1 when it is not a member."""
        groups = self._require()
        me = _state.topology().rank
        return groups.ranks.index(me) if me in groups.ranks else -1

    def included(self) -> bool:
        """Whether this process is a member of the set."""
        return _state.topology().rank in self._require().ranks

    def __repr__(self) -> str:
        return f"ProcessSet(process_set_id={self.process_set_id}, ranks={self.ranks})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ProcessSet) and (self.process_set_id, self.ranks) == (
            other.process_set_id,
            other.ranks,
        )

    def __hash__(self) -> int:
        return hash((self.process_set_id, tuple(self.ranks)))


class _Registry:
    def __init__(self) -> None:
        self.sets: dict[int, ProcessSet] = {}
        self.groups: dict[tuple[int, ...], _Groups] = {}
        self.next_id = 0
        self.static_done = False
        self.dynamic = False  # hvd.init(process_sets="dynamic")

    def reset(self) -> None:
        self.__init__()  # type: ignore[misc]


REGISTRY = _Registry()
global_process_set = ProcessSet([])


def _groups_for(ranks: tuple[int, ...]) -> _Groups:
    """Create (collectively, on every rank) or reuse the control and data groups of a membership."""
    cached = REGISTRY.groups.get(ranks)
    if cached is not None:
        return cached
    world = tuple(range(dist.get_world_size()))
    via_shm = False
    if ranks == world and dist.get_world_size() == 1:
        ctrl = data = grad = dist.group.WORLD
    else:
        backend = "cpu:gloo,cuda:nccl" if _state.STATE.cuda_backend else "gloo"
        ctrl = dist.new_group(list(ranks), backend="gloo")
        data = dist.new_group(list(ranks), backend=backend)
        grad = dist.new_group(list(ranks), backend=backend)
        transport = shm.build(ranks, ctrl)  # same-host ranks: payloads and control blocks in shared memory
        if transport is not None:
            shm.register({"ctrl": ctrl, "data": data, "grad": grad}, transport)
        via_shm = transport is not None
    groups = _Groups(ctrl=ctrl, data=data, grad=grad, ranks=ranks, shm=via_shm)
    REGISTRY.groups[ranks] = groups
    return groups


def _register(ps: ProcessSet) -> ProcessSet:
    size = dist.get_world_size()
    bad = [r for r in ps.ranks if not 0 <= r < size]
    if bad or not ps.ranks:
        raise ValueError(f"process set ranks {ps.ranks} must be a non-empty subset of 0..{size - 1}")
    for existing in REGISTRY.sets.values():
        if existing is ps:
            return ps
    ps._groups = _groups_for(tuple(ps.ranks))
    ps.process_set_id = REGISTRY.next_id
    REGISTRY.next_id += 1
    REGISTRY.sets[ps.process_set_id] = ps
    return ps


def _agree(requested: list[list[int]], what: str) -> None:
    """Check, on every rank, that every rank asked for the same sets (``new_group`` with different ranks
    on different processes would hang or build wrong groups).

    Raises:
        CollectiveMismatchError: the ranks asked for different sets (raised on every rank).
    """
    if dist.get_world_size() == 1:
        return
    from phalanx.torch.functions import allgather_object

    seen = allgather_object(requested, name=what, process_set=global_process_set)
    if any(s != seen[0] for s in seen[1:]):
        from phalanx.errors import CollectiveMismatchError

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
    REGISTRY.reset()
    REGISTRY.dynamic = dynamic
    global_process_set.ranks = list(range(dist.get_world_size()))
    global_process_set.process_set_id = None
    _register(global_process_set)
    if process_sets:
        _agree([list(ps.ranks) for ps in process_sets], "hvd.init(process_sets=...)")
    for ps in process_sets or ():
        _register(ps)


def clear_process_sets() -> None:
    """Forget every set (on ``hvd.shutdown``)."""
    shm.clear()
    for ps in REGISTRY.sets.values():
        ps.process_set_id = None
        ps._groups = None
    REGISTRY.reset()


def _dynamic_enabled() -> bool:
    raw = os.environ.get(N.HOROVOD_DYNAMIC_PROCESS_SETS, "")
    return REGISTRY.dynamic or raw.strip().lower() in ("1", "true", "yes")


def add_process_set(process_set: ProcessSet | Sequence[int]) -> ProcessSet:
    """Register a process set after ``init`` (collective: every rank must call it, in the same order).

    Args:
        process_set: a :class:`ProcessSet` or a list of global ranks.

    Returns:
        The registered set (with its ``process_set_id``).

    Raises:
        ValueError: dynamic process sets are not enabled (``hvd.init(process_sets="dynamic")`` or
            ``HOROVOD_DYNAMIC_PROCESS_SETS=1``), or the ranks are invalid.
        CollectiveMismatchError: ranks passed different sets (a ``RuntimeError``, raised on every rank).
    """
    _state.topology()
    if not _dynamic_enabled():
        raise ValueError(
            f"adding a process set after init requires hvd.init(process_sets='dynamic') or "
            f"{N.HOROVOD_DYNAMIC_PROCESS_SETS}=1 in the environment of every rank (or pass the set to "
            "hvd.init(process_sets=[...]))"
        )
    ps = process_set if isinstance(process_set, ProcessSet) else ProcessSet(process_set)
    _agree([list(ps.ranks)], "add_process_set")
    return _register(ps)


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
    if psid is None or psid == 0 or REGISTRY.sets.get(psid) is not process_set:
        return False
    del REGISTRY.sets[psid]
    process_set.process_set_id = None
    process_set._groups = None
    return True


def groups_of(process_set: ProcessSet) -> _Groups:
    """The control/data groups of a registered set.

    Raises:
        NotInitializedError: before ``hvd.init()``.
        ValueError: the set is not registered, or this rank is not a member.
    """
    groups = process_set._require()
    if _state.topology().rank not in groups.ranks:
        raise ValueError(
            f"rank {_state.topology().rank} is not a member of {process_set!r}; only members may run "
            "collectives on it"
        )
    return groups
