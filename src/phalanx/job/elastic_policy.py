"""How the driver judges an elastic job: a pure policy, and a monitor that re-forms instead of failing.

:class:`ElasticPolicy` decides, from counts only, whether a lost worker ends the job or the world
re-forms. :class:`ElasticMonitor` extends :class:`JobMonitor`: a worker that dies (or raises) is *lost*,
not failed, while the policy says re-form; the launcher's ``reform`` callback then starts replacements
and publishes the next round. Results come from the final world, in its rank order.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from phalanx.errors import InvalidArgumentError, WorkerFailedError
from phalanx.job.channel import Event
from phalanx.job.monitor import JobMonitor, RankExit, _RankState
from phalanx.job.observation import Reformed
from phalanx.job.records import ErrorRecord


@dataclass(frozen=True)
class Decision:
    """What to do after a loss: re-form with ``size`` workers, or fail for ``reason``."""

    reform: bool
    size: int
    reason: str = ""


@dataclass(frozen=True)
class ElasticPolicy:
    """When an elastic job goes on.

    Attributes:
        min_np: fewest workers the job may run with.
        max_np: most workers the job may run with.
        reset_limit: most re-formations before the job fails (None: no limit).
    """

    min_np: int
    max_np: int
    reset_limit: int | None = None

    def __post_init__(self) -> None:
        if self.min_np < 1 or self.max_np < self.min_np:
            raise InvalidArgumentError(
                f"elastic job needs 1 <= min_np <= max_np; got min_np={self.min_np}, max_np={self.max_np}")
        if self.reset_limit is not None and self.reset_limit < 0:
            raise InvalidArgumentError(f"reset_limit must be >= 0 (or None); got {self.reset_limit}")

    def decide(self, alive: int, free_slots: int, resets: int, holding_state: int | None = None) -> Decision:
        """Decide after a worker was lost.

        Args:
            alive: workers still running.
            free_slots: replacements the launcher could start now.
            resets: re-formations so far.
            holding_state: how many of the alive workers hold the training state (None: all of them); with
                none, a new world could only start over from scratch.

        Returns:
            Re-form with ``min(max_np, alive + free_slots)`` workers, or fail with the reason.
        """
        if holding_state == 0 or alive == 0:
            return Decision(False, alive, "no surviving worker holds the training state (every worker of "
                                          "the last formed world was lost; is the error deterministic?)")
        if self.reset_limit is not None and resets >= self.reset_limit:
            return Decision(False, alive, f"{RESET_LIMIT_EXCEEDED} {self.reset_limit} (reset_limit="
                                          f"{self.reset_limit} reached after {resets} resets; raise reset_limit "
                                          "(--reset-limit) to tolerate more losses)")
        size = min(self.max_np, alive + free_slots)
        if size < self.min_np:
            return Decision(False, size, f"only {size} worker(s) left, below min_np={self.min_np}; "
                                         "lower min_np (--min-np) or free slots")
        return Decision(True, size)


# Horovod's text (horovod.runner.elastic.constants), which users grep logs for; the limit follows it.
RESET_LIMIT_EXCEEDED = "Horovod was shutdown because number of resets during elastic job exceeded limit:"


@dataclass(frozen=True)
class HostsUpdated:
    """Host discovery reported ``slots`` for the job (a launcher puts this in the monitor's event queue)."""

    slots: int


@dataclass
class ElasticMonitor(JobMonitor):
    """A :class:`JobMonitor` whose lost workers trigger a re-formation while the policy allows.

    Attributes:
        policy: the decision object.
        reform: ``reform(alive_ids, size) -> new world`` (worker ids in rank order); starts replacements
            and publishes the round. Called in the monitor's thread.
        free_slots: how many replacements the launcher can start, given the alive worker ids.
        holds_state: whether a worker holds the training state (one of the first world's, or it synced
            in the current round).
        give_up: a reason to fail instead of re-forming, whatever the policy says (e.g. Spark failed the
            whole stage); empty when there is none.
        leaving: the worker ids the launcher is stopping (their host left the job); they count as lost
            already, and their end re-forms nothing once a world without them was formed.
    """

    policy: ElasticPolicy = field(default_factory=lambda: ElasticPolicy(1, 1, 0))
    reform: Callable[[list[int], int], list[int]] = lambda alive, size: alive
    free_slots: Callable[[list[int]], int] = lambda alive: 0
    holds_state: Callable[[int], bool] = lambda worker: True
    give_up: Callable[[], str] = lambda: ""
    leaving: Callable[[], set[int]] = lambda: set()
    world: list[int] = field(init=False, default_factory=list)
    resets: int = field(init=False, default=0)
    _spawned_at: list[float] = field(init=False, default_factory=list)
    _lost: set[int] = field(init=False, default_factory=set)
    _gave_up: str = field(init=False, default="")

    def __post_init__(self) -> None:
        super().__post_init__()
        self.world = list(range(self.config.world_size))
        self._spawned_at = [time.monotonic()] * self.config.world_size

    def add_worker(self) -> int:
        """Track one more worker (a replacement); return its id."""
        self._ranks.append(_RankState())
        self._spawned_at.append(time.monotonic())
        return len(self._ranks) - 1

    def _judge(self) -> list[Any]:
        """Block until the final world is done; return its values in rank order.

        Raises:
            WorkerFailedError: the policy gave up, or a worker of the final world failed.
            StartTimeoutError: a worker did not start within the start timeout.
        """
        while not all(r.exited or self._retired(w) for w, r in enumerate(self._ranks)):
            self._drain(timeout=0.05)
            self._check_start(0.0)
            if self._stopped_at is not None and time.monotonic() - self._stopped_at > self.config.stop_wait_s:
                break
        self._flush()
        failures = self._failures()
        if self._stopped_at is not None and failures:
            root = failures[0]
            note = f"{root.summary} (elastic job gave up: {self._gave_up or 'stopped'}; ranks are worker ids)"
            raise WorkerFailedError([replace(root, summary=note), *failures[1:]])
        return [self._load(rank, self._ranks[wid]) for rank, wid in enumerate(self.world)]

    def _handle(self, event: Event | RankExit | HostsUpdated) -> None:
        if isinstance(event, HostsUpdated):
            if not self._drop_leaving():
                self._grow(event.slots)
            return
        if isinstance(event, ErrorRecord):
            self._ranks[event.rank].error = event  # judged when the process ends
            return
        super()._handle(event)

    def _exited(self, state: _RankState, returncode: int, ended_at: float | None) -> None:
        state.exited = True
        state.returncode = returncode
        if returncode == 0 and (state.result is not None or not self.config.expect_results):
            return
        state.failed_at = time.monotonic() if ended_at is None else ended_at
        if self._stopped_at is not None:
            return
        wid = next(w for w, s in enumerate(self._ranks) if s is state)
        self._lost.add(wid)
        if wid in self.leaving() and wid not in self.world:
            return  # retired, and the current world was formed without it
        self._on_loss(state)

    def _alive(self) -> list[int]:
        leaving = self.leaving()
        return [w for w, s in enumerate(self._ranks) if not s.exited and w not in leaving]

    def _retired(self, wid: int) -> bool:
        # Being stopped, and the current world was formed without it: the launcher's teardown ends it.
        return wid in self.leaving() and wid not in self.world

    def _finished(self) -> bool:
        return any(s.result is not None for s in self._ranks)

    def _decide(self) -> tuple[list[int], Decision]:
        alive = self._alive()
        holding = sum(1 for w in alive if self.holds_state(w))
        return alive, self.policy.decide(len(alive), self.free_slots(alive), self.resets, holding)

    def _on_loss(self, state: _RankState) -> None:
        alive, decision = self._decide()
        forced = self.give_up()
        if forced or self._finished() or not decision.reform:
            self._gave_up = forced or decision.reason or "a worker was lost after others had finished"
            self._fail(state)
            return
        self._reform_to(alive, decision.size)

    def _drop_leaving(self) -> bool:
        """Re-form at once without the world's workers the launcher is stopping (their host left the job),
        as Horovod resets when a host goes; False when none is in the world or the policy says no (their
        ends are then judged as any loss)."""
        if self._stopped_at is not None or self._finished() or not self.leaving() & set(self.world):
            return False
        alive, decision = self._decide()
        if self.give_up() or not decision.reform:
            return False
        self._reform_to(alive, decision.size)
        return True

    def _reform_to(self, alive: list[int], size: int) -> None:
        self.resets += 1
        self.world = self.reform(alive, size)
        if self.observer is not None:
            self.observer(Reformed(self.resets, tuple(self.world)))
        while len(self._ranks) <= max(self.world):
            self.add_worker()

    def _grow(self, slots: int) -> None:
        """More slots were discovered: add workers up to ``max_np`` (a re-formation: it counts as a reset)."""
        alive = self._alive()
        size = min(self.policy.max_np, slots)
        if self._stopped_at is not None or self._finished() or size <= len(alive):
            return
        if self.policy.reset_limit is not None and self.resets >= self.policy.reset_limit:
            return  # growing is an opportunity, not a need: the job goes on at its size
        self._reform_to(alive, size)

    def _check_start(self, started: float) -> None:
        # ``started`` is unused: every worker is judged from its own start (replacements start late).
        if not self.config.expect_hello or self._stopped_at is not None:
            return
        now = time.monotonic()
        for wid, state in enumerate(self._ranks):
            if not state.hello and not state.exited and now - self._spawned_at[wid] > self.config.start_timeout_s:
                super()._check_start(self._spawned_at[wid])  # raises StartTimeoutError
