"""Every exception phalanx raises.

One base class, :class:`PhalanxError`. Subclasses also derive from the builtin a caller would expect
(``ValueError`` for bad arguments, ``TimeoutError`` for waits that ran out, ``RuntimeError`` for failed
workers), so ``except ValueError`` keeps working. Every class survives pickling, because errors travel
from worker processes and Spark executors to the driver.
"""

from __future__ import annotations

import re
import signal
from dataclasses import dataclass, field
from typing import Any


class PhalanxError(Exception):
    """Base class of every phalanx exception."""

    def __reduce__(self) -> tuple[Any, ...]:
        # Exceptions pickle as ``cls(*self.args)``; keep that explicit so subclasses with keyword-only
        # state can override it and so the rule is visible.
        return (self.__class__, self.args)


class InvalidArgumentError(PhalanxError, ValueError):
    """An argument or setting has a value phalanx cannot use; the message names it and the fix."""


class SettingError(InvalidArgumentError):
    """An environment variable phalanx reads has a value it cannot parse (``phalanx.env.settings``); the
    message names the variable, the value and what it must be."""


class UsageError(PhalanxError, RuntimeError):
    """A call that cannot work in the mode or state it was made in (e.g. a graph-only call in eager mode, or
    more ranks than the data can be split into); the message says what to do instead."""


class PayloadError(PhalanxError, TypeError):
    """The function or its arguments cannot be serialized; the message names the offending object."""


class StartTimeoutError(PhalanxError, TimeoutError):
    """Some ranks did not start within the start timeout; the message names them and the knob."""


class ChannelError(PhalanxError, ConnectionError):
    """The driver/worker channel failed (connection lost, bad frame, authentication refused)."""


class WorkerContractError(PhalanxError, RuntimeError):
    """A worker's environment is missing or has malformed contract variables."""


class JobAbortedError(PhalanxError, RuntimeError):
    """The job was stopped by the driver (interrupt, or another rank's failure)."""


class TimelineError(PhalanxError, OSError):
    """The timeline cannot be written (the path's directory is missing or read-only) or read."""


class CollectiveMismatchError(PhalanxError, RuntimeError):
    """Ranks issued a collective that disagrees (shape, dtype, op, root rank, process set, kind or name).

    Raised on every participating rank; the message names the tensor, the ranks and the values each saw.
    """


class ShmTransportError(PhalanxError, RuntimeError):
    """A shared-memory collective could not complete: a peer rank died or stalled past the deadline.

    The message names the rank(s), the step and the knob (``PHALANX_SHM_TIMEOUT_S``, ``PHALANX_SHM=0``).
    """


#: How a phalanx error says that a peer rank died first (``peer rank N (pid P) has died or exited ...``); the
#: driver reads it back (:func:`lost_peer_rank`) to put the dead rank first in the failure report.
PEER_DIED = "has died or exited"
_PEER_DIED_RE = re.compile(r"\bpeer rank (\d+) \(pid \d+\) " + re.escape(PEER_DIED))


def lost_peer_rank(message: str) -> int | None:
    """The rank a phalanx error names as having died before the collective it waited in (None: none named)."""
    found = _PEER_DIED_RE.search(message)
    return int(found.group(1)) if found else None


class NotInitializedError(PhalanxError, ValueError):
    """A ``phalanx.torch`` function was called before ``hvd.init()``."""


class SlotsUnavailableError(PhalanxError, RuntimeError):
    """The Spark cluster cannot run every rank at once (a barrier stage needs them all together).

    The message gives the ranks asked for, the task slots available and the setting to change.
    """


class SparkJobError(PhalanxError, RuntimeError):
    """Spark itself failed the job's barrier stage (lost executor, refused stage), not the user's code."""


class HorovodInternalError(PhalanxError, RuntimeError):
    """A collective failed because the world changed (a peer died); ``hvd.elastic.run`` rolls back to the
    last commit and re-forms the world. Horovod's name."""


class HostsUpdatedInterrupt(PhalanxError, RuntimeError):
    """The driver published a new world; raised by ``state.check_host_updates()`` / ``state.commit()``.

    Args:
        skip_sync: True when the state need not be re-broadcast after the reset (Horovod's meaning).
    """

    def __init__(self, skip_sync: bool = False) -> None:
        super().__init__(skip_sync)
        self.skip_sync = skip_sync


class ElasticTimeoutError(PhalanxError, TimeoutError):
    """An elastic worker waited too long for the driver's next round; the message names the knob."""


class CheckpointError(PhalanxError, OSError):
    """An elastic checkpoint could not be written or read; the message names the path and the cause."""


def describe_exit(returncode: int) -> str:
    """Describe a process return code as a person reads it.

    Args:
        returncode: ``Popen.returncode``: negative for death by a signal.

    Returns:
        ``"exit code 3"`` or ``"signal SIGKILL (9)"``.
    """
    if returncode >= 0:
        return f"exit code {returncode}"
    signum = -returncode
    try:
        name = signal.Signals(signum).name
    except ValueError:
        name = f"signal {signum}"
    return f"signal {name} ({signum})"


def shell_exit_code(returncode: int) -> int:
    """Map a ``Popen.returncode`` to the exit code a shell reports (a signal N gives 128 + N)."""
    return 128 - returncode if returncode < 0 else returncode


@dataclass(frozen=True)
class RankFailure:
    """What went wrong on one rank.

    Attributes:
        rank: the global rank.
        summary: one line: ``ZeroDivisionError: division by zero`` or ``killed by signal SIGKILL (9)``.
        traceback: the traceback text, phalanx's frames folded (empty when the rank died without one).
        log_tail: the last lines the rank wrote, oldest first.
        returncode: the process return code when known (negative: killed by that signal).
        exc_type: qualified name of the exception type, when the rank raised one.
        secondary: True when phalanx stopped the rank because another rank failed first.
        host: the host the rank ran on.
        where: the user's frame the failure happened in, ``path:line in func`` (empty when unknown).
        traceback_shown: the traceback is in the rank's output, which the console already showed.
    """

    rank: int
    summary: str
    traceback: str = ""
    log_tail: tuple[str, ...] = field(default_factory=tuple)
    returncode: int | None = None
    exc_type: str | None = None
    secondary: bool = False
    host: str = ""
    where: str = ""
    traceback_shown: bool = False

    def headline(self, verb: str = "failed") -> str:
        """``rank 1 [on host h] failed at train.py:5 in step: ValueError: bad`` (the report's first line)."""
        host = f" [on host {self.host}]" if self.host else ""
        where = f" at {self.where}" if self.where else ""
        return f"rank {self.rank}{host} {verb}{where}: {self.summary}"

    def render(self) -> str:
        """The root cause's block of the job error's message: the headline, then the traceback (unless
        the console showed it already) or the rank's last lines."""
        lines = [self.headline()]
        if self.traceback and self.traceback_shown:
            lines.append(f"  (rank {self.rank}'s traceback is above, in its output)")
        elif self.traceback:
            lines.extend("  " + ln for ln in self.traceback.rstrip("\n").splitlines())
        elif self.log_tail:
            lines.append(f"  Last {len(self.log_tail)} log lines of rank {self.rank}:")
            lines.extend("    " + ln for ln in self.log_tail)
        return "\n".join(lines)


class WorkerFailedError(PhalanxError, RuntimeError):
    """One or more ranks failed; the root cause (earliest failure) comes first.

    The message is one report: the root cause's headline (rank, host, the user's file and line, the
    exception), its traceback, then one line per rank that failed after it and one for the ranks phalanx
    stopped.

    Attributes:
        failures: every failed rank, root cause first.
        root_cause: ``failures[0]``.
        exit_code: the shell exit code of the root-cause rank (``128 + N`` for signal N), 1 when it raised.
    """

    def __init__(self, failures: list[RankFailure] | tuple[RankFailure, ...]) -> None:
        if not failures:
            raise InvalidArgumentError("WorkerFailedError needs at least one RankFailure")
        self.failures: tuple[RankFailure, ...] = tuple(failures)
        super().__init__(self._message())

    @property
    def root_cause(self) -> RankFailure:
        """The earliest failure, which most likely caused the others."""
        return self.failures[0]

    @property
    def exit_code(self) -> int:
        """Exit code for a CLI: the root cause's shell exit code, or 1 when it raised an exception."""
        rc = self.root_cause.returncode
        if rc is None or rc == 0:
            return 1
        return shell_exit_code(rc)

    def _message(self) -> str:
        blocks = [self.root_cause.render()]
        later = [f for f in self.failures[1:] if not f.secondary]
        blocks.extend("After it: " + f.headline("failed too") for f in later)
        stopped = [str(f.rank) for f in self.failures[1:] if f.secondary]
        if stopped:
            blocks.append(f"Stopped by phalanx after the root cause (not failed): rank(s) {', '.join(stopped)}")
        return "\n".join(blocks)

    def __reduce__(self) -> tuple[Any, ...]:
        return (self.__class__, (self.failures,))
