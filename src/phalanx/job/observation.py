"""What the job monitor tells an observer (the live page, metrics, MLflow) as the job goes.

The monitor calls the observer in its own thread, once per event, with one of the typed observations below
(or a :class:`~phalanx.job.records.LogLine` / :class:`~phalanx.job.stats.RankStats` as it arrived). An
observer must return at once (no I/O that can block): it updates its own bounded state and lets its own
threads do the rest. The monitor knows nothing of what an observer does with them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from phalanx.job.records import LogLine
from phalanx.job.stats import RankStats


@dataclass(frozen=True)
class RankStarted:
    """A rank's worker reached the driver (its hello): where it runs and when (driver's monotonic clock)."""

    rank: int
    pid: int
    host: str
    at: float


@dataclass(frozen=True)
class RankEnded:
    """A rank's process ended and was judged.

    Attributes:
        rank: the rank.
        returncode: its exit code.
        failed: whether it counts as a failure (for an elastic job: a lost worker).
        cause: why it failed (``Type: message``, or how the process ended); empty when it did not.
        stopped: it ended by the teardown phalanx started after an earlier failure of another rank.
    """

    rank: int
    returncode: int
    failed: bool
    cause: str = ""
    stopped: bool = False


@dataclass(frozen=True)
class Reformed:
    """An elastic job re-formed its world (``resets`` so far; ``world``: worker ids in rank order)."""

    resets: int
    world: tuple[int, ...]


@dataclass(frozen=True)
class JobEnded:
    """The job is judged: ``report`` is the failure report (root cause first) or a summary of the result."""

    ok: bool
    report: str
    ranks: Sequence[int] = ()


Observation = RankStarted | RankEnded | Reformed | JobEnded | LogLine | RankStats
#: What the monitor calls with each observation.
Observer = Callable[[Observation], None]
