"""Process sets: named subsets of ranks that run collectives among themselves (Horovod's ``ProcessSet``).

Each distinct membership gets three ``torch.distributed`` groups: a gloo *control* group that carries the
fixed-size signature blocks (see ``_header``), a *data* group (gloo for CPU, NCCL for CUDA tensors) that
carries payloads, and a *grad* group for the ``DistributedOptimizer``'s buckets (so that an explicit
collective issued between ``backward()`` and ``step()`` can never interleave differently with them).
Process sets with the same members share their groups, so that two ranks naming
different sets with the same members are caught by the signature check instead of hanging. Registering sets
on every rank (a collective) is ``_membership``'s.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass
from numbers import Integral
from typing import Any

import torch.distributed as dist

from phalanx.errors import InvalidArgumentError
from phalanx.torch._runtime import RUNTIME
from phalanx.torch._setup import state as _state
from phalanx.transport import api as shm


@dataclass
class _Groups:
    ctrl: Any
    data: Any
    grad: shm.GradChannel  # the DistributedOptimizer's buckets: never interleaved with explicit collectives
    ranks: tuple[int, ...]
    shm: bool = False  # CPU payloads travel through shared memory (grad: deferred to wait(), see transport._dispatch)


class ProcessSet:
    """A subset of ranks that runs collectives together.

    Args:
        ranks_or_comm: the global ranks of the set: any iterable of ints (a list, a range, a generator...),
            in any order (sorted here, as Horovod does; duplicates are an error). An MPI communicator is
            not supported (phalanx does not use MPI).

    Attributes:
        process_set_id: the id assigned when the set is registered (``None`` before).
        ranks: the sorted global ranks of the set.
    """

    def __init__(self, ranks_or_comm: Iterable[int]) -> None:
        if isinstance(ranks_or_comm, str | bytes) or not isinstance(ranks_or_comm, Iterable):
            raise InvalidArgumentError(
                f"ProcessSet takes an iterable of global ranks, got {type(ranks_or_comm).__name__}; "
                "MPI communicators are not supported by phalanx"
            )
        given = list(ranks_or_comm)
        if any(isinstance(r, bool) or not isinstance(r, Integral) for r in given):
            raise InvalidArgumentError(f"ProcessSet ranks must be ints, got {given}")
        ranks = sorted(int(r) for r in given)
        if len(set(ranks)) != len(ranks):
            raise InvalidArgumentError(f"ProcessSet ranks must be distinct, got {given}")
        self.ranks: list[int] = ranks
        self.process_set_id: int | None = None
        self._groups: _Groups | None = None

    def _require(self) -> _Groups:
        _state.topology()
        if self.process_set_id is None or self._groups is None:
            raise InvalidArgumentError(
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

    def __str__(self) -> str:
        return f"ProcessSet(process_set_id={self.process_set_id}, ranks={self.ranks}, mpi_comm=None)"  # Horovod's

    __repr__ = __str__

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ProcessSet) and (self.process_set_id, self.ranks) == (
            other.process_set_id,
            other.ranks,
        )

    def __hash__(self) -> int:
        return hash((self.process_set_id, tuple(self.ranks)))


global_process_set = ProcessSet([])


def _groups_for(ranks: tuple[int, ...]) -> _Groups:
    """Create (collectively, on every rank) or reuse the control and data groups of a membership."""
    cached = RUNTIME.registry.groups.get(ranks)
    if cached is not None:
        return cached
    world = tuple(range(dist.get_world_size()))
    via_shm = False
    if ranks == world and dist.get_world_size() == 1:
        ctrl = data = grad = dist.group.WORLD
    else:
        backend = "cpu:gloo,cuda:nccl" if RUNTIME.process.cuda_backend else "gloo"
        timeout = _state.gloo_timeout(os.environ)  # the user's, on every group (else torch's 30 min default)
        ctrl = dist.new_group(list(ranks), backend="gloo", timeout=timeout)
        data = dist.new_group(list(ranks), backend=backend, timeout=timeout)
        grad = dist.new_group(list(ranks), backend=backend, timeout=timeout)
        transport = shm.build(ranks, ctrl, timeout)  # same-host ranks: payloads and control blocks in shared memory
        if transport is not None:
            shm.register({"ctrl": ctrl, "data": data, "grad": grad}, transport)
        via_shm = transport is not None
    groups = _Groups(ctrl=ctrl, data=data, grad=shm.GradChannel(grad), ranks=ranks, shm=via_shm)
    RUNTIME.registry.groups[ranks] = groups
    return groups


def _register(ps: ProcessSet) -> ProcessSet:
    size = dist.get_world_size()
    bad = [r for r in ps.ranks if not 0 <= r < size]
    if bad or not ps.ranks:
        raise InvalidArgumentError(f"process set ranks {ps.ranks} must be a non-empty subset of 0..{size - 1}")
    for existing in RUNTIME.registry.sets.values():
        if existing is ps:
            return ps
    ps._groups = _groups_for(tuple(ps.ranks))
    ps.process_set_id = RUNTIME.registry.next_id
    RUNTIME.registry.next_id += 1
    RUNTIME.registry.sets[ps.process_set_id] = ps
    return ps


def abandon_process_sets(cause: str) -> None:
    """Give up the shared-memory channels of every set (this rank leaves its collectives unfinished, e.g. an
    elastic rank rolling back alone): peers blocked in them fail at their next check with ``cause``'s rank
    named, instead of waiting out ``PHALANX_SHM_TIMEOUT_S``. ``clear_process_sets`` still closes them."""
    shm.abandon(cause)


def clear_process_sets() -> None:
    """Forget every set (on ``hvd.shutdown``; ``RUNTIME.reset()`` then drops the registry)."""
    shm.clear()
    for ps in RUNTIME.registry.sets.values():
        ps.process_set_id = None
        ps._groups = None


def registered(process_set_id: int) -> ProcessSet | None:
    """The registered set of ``process_set_id`` (0: the global set), or None."""
    return RUNTIME.registry.sets.get(process_set_id)


def groups_of(process_set: ProcessSet) -> _Groups:
    """The control/data groups of a registered set.

    Raises:
        NotInitializedError: before ``hvd.init()``.
        ValueError: the set is not registered, or this rank is not a member.
    """
    groups = process_set._require()
    if _state.topology().rank not in groups.ranks:
        raise InvalidArgumentError(
            f"rank {_state.topology().rank} is not a member of {process_set!r}; only members may run "
            "collectives on it"
        )
    return groups
