"""The transport's interface to phalanx.torch: the only module of the layer its callers import (with
:mod:`.backend`, the ``torch.distributed`` backend, for torch-native code).

Per process set, the caller builds a :class:`Transport` (:func:`build`, collective over the job) and
registers its torch groups by channel kind (:func:`register`: ``ctrl``, ``data``, ``grad``); from then on
:func:`all_reduce`, :func:`all_gather_single` and :func:`broadcast` take ``torch.distributed``'s
signatures and carry a registered group's CPU tensors through shared memory (``torch.distributed``
otherwise). The ``grad`` group is used through one object, :class:`GradChannel`: the optimizer's
asynchronous sums and the calls only a shared-memory grad channel answers (several tensors in place, an
empty step, the early-reduction area). :func:`clear` closes every transport;
:func:`abandon` first gives up their channels, so that peers blocked in them fail at once (a rank that
rolls back alone).

The transport knows nothing of its callers: a caller that inspects slow waits (phalanx.torch's stall
inspector) passes its callbacks in with :func:`set_wait_hooks`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from phalanx.transport import _dispatch, native
from phalanx.transport._control import HOOKS
from phalanx.transport._dispatch import Done, abandon, all_gather_single, all_reduce, broadcast, clear, register
from phalanx.transport._dtypes import dtype_code, dtype_name, dtype_of
from phalanx.transport._early import Area as EarlyArea
from phalanx.transport._setup import Transport, build, enabled

__all__ = ["Done", "EarlyArea", "GradChannel", "Transport", "WaitHooks", "abandon", "all_gather_single",
           "all_reduce", "broadcast", "build", "clear", "dtype_code", "dtype_name", "dtype_of", "enabled",
           "init_process_group", "register", "set_wait_hooks"]


@dataclass(frozen=True)
class GradChannel:
    """A process set's ``grad`` group as the DistributedOptimizer uses it: the narrow seam between the
    optimizer's buckets and the transport.

    On a single-host shared-memory grad channel the calls take the transport's fast paths; on any other
    group :meth:`all_reduce` is ``torch.distributed``'s and the others answer None / False / True so the
    caller takes its plain path.

    Attributes:
        group: the ``torch.distributed`` group registered as ``grad`` (:func:`register`).
    """

    group: Any

    def overlaps(self) -> bool:
        """Whether an asynchronous sum runs while the caller goes on, rather than deferred to ``wait()``."""
        return _dispatch.overlaps(self.group)

    def all_reduce(self, tensor: torch.Tensor, inline: bool = False) -> Any:
        """Start an asynchronous in-place sum of ``tensor``; ``inline``: run it in the thread that waits for
        it (after the calls issued before it) rather than on the transport's worker thread."""
        return _dispatch.all_reduce(tensor, op=dist.ReduceOp.SUM, group=self.group, async_op=True, inline=inline)

    def all_reduce_many(self, tensors: list[torch.Tensor], scale: float = 1.0, inline: bool = False,
                        nbytes: int = -1, start: int = 0) -> Any:
        """Sum the concatenation of ``tensors`` in place, straight from and into them, each rank's share
        multiplied by ``scale``, from byte ``start`` on; None when the channel cannot (the caller then fuses
        them and calls :meth:`all_reduce`, which meets this call on the other ranks)."""
        return _dispatch.all_reduce_many(tensors, self.group, scale, inline, nbytes, start)

    def barrier(self) -> Any:
        """An empty step after the queued calls (a bucket reduced early in full still advances the
        channel's step number); returns its work."""
        return _dispatch.grad_barrier(self.group)

    def early_claim(self, key: tuple[int, int], sizes: list[int], fingerprint: int) -> EarlyArea | None:
        """The early-reduction area for the caller's ``key`` (None when the channel has none)."""
        return _dispatch.early_claim(self.group, key, sizes, fingerprint)

    def early_find(self, key: tuple[int, int]) -> EarlyArea | None:
        """The area ``key`` claimed (a rank that no longer contributes answers its steps), or None."""
        return _dispatch.early_find(self.group, key)


@dataclass(frozen=True)
class WaitHooks:
    """Callbacks a shared-memory wait (and a leader's gloo wait across hosts) consults once it is slow.

    Attributes:
        stalled: called with the seconds waited at every check of a slow wait; returns an error to raise
            (the channel is then broken) or None to go on waiting.
        resumed: called once a wait that called ``stalled`` has ended.
        verdict: called before a peer's failure is raised; an error it returns is raised instead (a
            deadlocked peer that raised and exited is not a dead peer).
        pending: the caller's operation a failing wait served (``"allreduce 'loss' (process set 0, ranks
            [0, 1])"``), named first in the transport's error; None: the error names the transport's step.
    """

    stalled: Callable[[float], Exception | None]
    resumed: Callable[[], None]
    verdict: Callable[[], Exception | None]
    pending: Callable[[], str | None] | None = None


def set_wait_hooks(hooks: WaitHooks | None) -> None:
    """Install ``hooks`` for every channel of this process (None: waits consult nothing)."""
    HOOKS.stalled = hooks.stalled if hooks is not None else None
    HOOKS.resumed = hooks.resumed if hooks is not None else None
    HOOKS.verdict = hooks.verdict if hooks is not None else None
    HOOKS.pending = hooks.pending if hooks is not None else None


def init_process_group(*args: Any, **kwargs: Any) -> None:
    """``torch.distributed.init_process_group`` with exactly the backend asked for: in a rank where it is
    wrapped to substitute ``phalanx_shm`` for gloo (``phalanx.worker.dist_backend``), the wrapper leaves the
    backend alone. phalanx.torch's default group carries this transport's own groups, never a ``phalanx_shm``
    group."""
    with native.exact_backend():
        dist.init_process_group(*args, **kwargs)
