"""phalanx.torch's process-wide state: one :class:`Runtime`, ``RUNTIME``, and its one reset path.

Every piece of mutable state of ``phalanx.torch`` is a field of ``RUNTIME``, as plain data; the modules that
act on it (named at each class) hold none of their own. Two lifetimes:

* **one ``hvd.init()``**: the process group's topology, the engine (pending collectives, per-membership
  counters), the process-set registry, the grouped handles, the stall inspector and the hang report's
  watcher. :meth:`Runtime.reset` replaces them with fresh ones; ``hvd.shutdown()`` (``basics.shutdown``)
  calls it after releasing what they hold (the queued jobs, the watcher thread, the transport's wait hooks,
  the process sets' groups, the process group), so that the next ``hvd.init()`` starts from nothing.
  ``hvd.global_process_set`` is Horovod's public object and is kept: ``shutdown`` clears its id.
* **the process**, kept across ``shutdown`` on purpose: the job's store and generation (``init`` again
  rejoins the same job), an elastic job's round (the next ``init`` waits for the round after it), the
  per-thread inline mode (set only while a synchronous call runs), the ``*_async`` thread and its queue
  (``shutdown`` fails the queued jobs and forgets the finished ones; the thread waits for the next), and the
  DistributedOptimizers' bucket layouts (``_engine.join``: an optimizer built before a re-init, as in an
  elastic job, is still served by a joined rank, and every rank registers the same layouts in the same order).

This module imports nothing of phalanx.torch at run time (the field types are for the type checker only),
so every module of the package can read ``RUNTIME``.
"""

from __future__ import annotations

import itertools
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from phalanx.env import RankIdentity
    from phalanx.torch._engine.background import Job
    from phalanx.torch._engine.collective import Entry
    from phalanx.torch._engine.names import Table
    from phalanx.torch._engine.speculate import Predictor
    from phalanx.torch._health.deadlock import Record
    from phalanx.torch.compression import Compressor
    from phalanx.torch.process_sets import ProcessSet, _Groups

Ranks = tuple[int, ...]
#: A DistributedOptimizer's bucket layout: each bucket's (elements, dtype, device), and its compression.
Layout = tuple[list[tuple[int, "torch.dtype", "torch.device"]], "type[Compressor]"]


@dataclass
class ProcessState:
    """The process group ``init`` joined and this rank's place in it (``_setup.state``)."""

    topology: RankIdentity | None = None
    owns_group: bool = False  # init created the default group, so shutdown destroys it
    cuda_backend: bool = False


@dataclass
class EngineState:
    """The engine's queue, handles and per-membership counters (``_engine.core``; ``_engine.rounds`` receives
    it as an argument)."""

    queue: deque[Entry] = field(default_factory=deque)
    handles: dict[int, Entry] = field(default_factory=dict)
    inflight: dict[str, Entry] = field(default_factory=dict)  # named collectives not finished yet
    counter: itertools.count[int] = field(default_factory=itertools.count)
    predictors: dict[Ranks, Predictor] = field(default_factory=dict)
    rounds: dict[Ranks, int] = field(default_factory=dict)  # negotiated control blocks per membership
    issued: dict[Ranks, int] = field(default_factory=dict)  # submitted control blocks per membership
    tables: dict[Ranks, Table] = field(default_factory=dict)  # memberships with parked entries


@dataclass
class Inspector:
    """The stall inspector's settings and the current wait (``_health.stall``)."""

    check_s: float = 0.0  # 0: off
    shutdown_s: float = 0.0  # 0: never
    warn_s: float = 0.0  # 0: no stall warning
    warned: bool = False  # the current wait has been warned about
    check_td: timedelta = timedelta(0)
    poll_td: timedelta = timedelta(0)
    store: Any = None
    rank: int = 0
    size: int = 1
    counters: Callable[[], tuple[dict[Ranks, int], dict[Ranks, int]]] = lambda: ({}, {})
    mine: Record | None = None  # published and not yet cleared
    version: int = 0
    next_poll: float = 0.0
    interval: float = 0.0  # between two reads of the records (backs off); set when a rank publishes
    next_verdict: float = 0.0  # verdicts are looked for every POLL_S, without back-off
    candidate: dict[int, int] | None = None
    broken: dict[Ranks, str] = field(default_factory=dict)
    report: str = ""  # the hang report of the current wait, when this rank wrote one
    entry: Any = None  # the engine entry this rank waits for (set at each wait point; read only on a stall)


@dataclass
class Watcher:
    """The hang report's watcher: this rank answers report requests (``_health.hang``)."""

    store: Any = None
    rank: int = 0
    size: int = 1
    describe_wait: Callable[[], str | None] = lambda: None
    stop: threading.Event = field(default_factory=threading.Event)
    answered: int = 0  # the last request answered


@dataclass
class Registry:
    """The registered process sets and each membership's groups (``process_sets``, ``_setup.membership``)."""

    sets: dict[int, ProcessSet] = field(default_factory=dict)
    groups: dict[Ranks, _Groups] = field(default_factory=dict)
    next_id: int = 0
    static_done: bool = False
    dynamic: bool = False  # hvd.init(process_sets="dynamic")


@dataclass
class Grouped:
    """The handles of ``grouped_*_async`` calls: a group's handle -> its members' handles (``async_ops``)."""

    members: dict[int, list[int]] = field(default_factory=dict)
    ids: itertools.count[int] = field(default_factory=lambda: itertools.count(1 << 40))  # above the engine's


class Runner:
    """The ``*_async`` jobs: the queue, the thread and the jobs by handle (``_engine.background``)."""

    def __init__(self, first_handle: int) -> None:
        self.cond = threading.Condition()
        self.queue: deque[Job] = deque()
        self.jobs: dict[int, Job] = {}
        self.busy = 0  # jobs queued or running
        self.next_handle = first_handle
        self.thread: threading.Thread | None = None
        # Names of the jobs queued, running, or finished since the caller's thread last entered the engine
        # (``drain``): a name stays taken until the caller could have seen its job end, so a second call
        # right after the first raises whether or not the thread was quick. ``finished``: those that ended.
        self.inflight: set[str] = set()
        self.finished: set[str] = set()


#: Background handles live above the engine's and the groups' (``async_ops``).
FIRST_ASYNC_HANDLE = 1 << 50


class Mode(threading.local):
    """Per thread: the caller waits for the result at once, so collectives run on its thread (``async_ops``)."""

    inline = False


@dataclass
class Generations:
    """This process's view of the job's generations of ``hvd.init()`` (``_health.generations``)."""

    store: Any = None  # the launcher's store
    generation: int = 0
    rank: int = 0
    superseded: str | None = None  # why this generation can no longer run collectives


@dataclass
class Round:
    """This process's place in an elastic job (``elastic._rendezvous``)."""

    number: int = -1
    store: Any = None  # the driver's store (kept across rounds)


class Runtime:
    """All of phalanx.torch's state; one instance, ``RUNTIME`` (see the module docstring)."""

    def __init__(self) -> None:
        self.job = Generations()
        self.round = Round()
        self.mode = Mode()
        self.runner = Runner(FIRST_ASYNC_HANDLE)
        self.layouts: dict[int, list[Layout]] = {}  # process set id -> its DistributedOptimizers' layouts
        self.reset()

    def reset(self) -> None:
        """Forget everything of the last ``hvd.init()``. The caller has released what it held
        (``basics.shutdown``); the process-lifetime fields are left as they are."""
        self.process = ProcessState()
        self.engine = EngineState()
        self.registry = Registry()
        self.grouped = Grouped()
        self.inspector = Inspector()
        self.watcher = Watcher()


RUNTIME = Runtime()
