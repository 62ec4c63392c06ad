"""The transport's interface to phalanx.torch: the only module of the layer its callers import (with
:mod:`.backend`, the ``torch.distributed`` backend, for torch-native code).

Per process set, the caller builds a :class:`Transport` (:func:`build`, collective over the job) and
registers its torch groups by channel kind (:func:`register`: ``ctrl``, ``data``, ``grad``); from then on
:func:`all_reduce`, :func:`all_gather_single` and :func:`broadcast` take ``torch.distributed``'s
signatures and carry a registered group's CPU tensors through shared memory (``torch.distributed``
otherwise). The ``grad`` channel adds its own calls: :func:`all_reduce_many` (several tensors in place),
:func:`grad_barrier` (an empty step), :func:`early_claim` / :func:`early_find` (its early-reduction area)
and :func:`overlaps`. :func:`clear` closes every transport.

The transport knows nothing of its callers: a caller that inspects slow waits (phalanx.torch's stall
inspector) passes its callbacks in with :func:`set_wait_hooks`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from phalanx.transport import native
from phalanx.transport._channel import HOOKS
from phalanx.transport._dispatch import (
    Done,
    all_gather_single,
    all_reduce,
    all_reduce_many,
    broadcast,
    clear,
    early_claim,
    early_find,
    grad_barrier,
    overlaps,
    register,
)
from phalanx.transport._setup import Transport, build, enabled

__all__ = ["Done", "Transport", "WaitHooks", "all_gather_single", "all_reduce", "all_reduce_many", "broadcast",
           "build", "clear", "early_claim", "early_find", "enabled", "grad_barrier", "init_process_group",
           "overlaps", "register", "set_wait_hooks"]


@dataclass(frozen=True)
class WaitHooks:
    """Callbacks a shared-memory wait (and a leader's gloo wait across hosts) consults once it is slow.

    Attributes:
        stalled: called with the seconds waited at every check of a slow wait; returns an error to raise
            (the channel is then broken) or None to go on waiting.
        resumed: called once a wait that called ``stalled`` has ended.
        verdict: called before a peer's failure is raised; an error it returns is raised instead (a
            deadlocked peer that raised and exited is not a dead peer).
    """

    stalled: Callable[[float], Exception | None]
    resumed: Callable[[], None]
    verdict: Callable[[], Exception | None]


def set_wait_hooks(hooks: WaitHooks | None) -> None:
    """Install ``hooks`` for every channel of this process (None: waits consult nothing)."""
    HOOKS.stalled = hooks.stalled if hooks is not None else None
    HOOKS.resumed = hooks.resumed if hooks is not None else None
    HOOKS.verdict = hooks.verdict if hooks is not None else None


def init_process_group(*args: Any, **kwargs: Any) -> None:
    """``torch.distributed.init_process_group`` with exactly the backend asked for: in a rank where it is
    wrapped to substitute ``phalanx_shm`` for gloo (``phalanx.worker.dist_backend``), the wrapper leaves the
    backend alone. phalanx.torch's default group carries this transport's own groups, never a ``phalanx_shm``
    group."""
    with native.exact_backend():
        dist.init_process_group(*args, **kwargs)
