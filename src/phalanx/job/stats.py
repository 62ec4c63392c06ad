"""A rank's periodic stats record (steps, waits in collectives, bytes reduced) and the rank's side that sends it.

Off unless the launcher sets ``PHALANX_STATS_INTERVAL_S`` (it does when the job's live page, its metrics or
MLflow logging is on). Then the instrumented code (phalanx.torch's optimizer and engine) counts into this
module's globals, and one daemon thread per rank sends a :class:`RankStats` on the rank's authenticated
channel every interval (a ``STATS`` frame; nothing when nothing changed). When off, every counting call is
one global test. A function job's worker sends on its own channel; a command's rank (``phalanxrun python
train.py``) connects to the channel from ``hvd.init()`` (:func:`ensure_reporter`).

The record is JSON, small and bounded: the driver refuses a body over :data:`MAX_BYTES`, more than
:data:`MAX_KINDS` kinds, names that are not short words, and numbers that are negative or not finite.
"""

from __future__ import annotations

import atexit
import json
import logging
import math
import os
import re
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from phalanx.env import settings
from phalanx.errors import InvalidArgumentError

#: Largest STATS body the driver decodes.
MAX_BYTES = 4096
#: Most collective kinds one record may carry.
MAX_KINDS = 16
_NAME = re.compile(r"[A-Za-z][\w .-]{0,47}\Z")


@dataclass(frozen=True)
class KindStats:
    """Cumulative figures of one kind of collective (``allreduce``...) on one rank."""

    count: int
    wait_s: float
    nbytes: int


@dataclass(frozen=True)
class RankStats:
    """What a rank reports every interval; every figure but ``current`` is cumulative since it started.

    Attributes:
        rank: the rank (the channel's id: the worker id in an elastic job).
        pid: the rank's process id.
        host: the host it runs on.
        clock_s: the rank's ``time.monotonic()`` when the record was made (rates are taken on the rank's clock,
            so a record delayed on the way does not distort them).
        steps: optimizer steps (``DistributedOptimizer.step()``).
        wait_s: seconds spent waiting for collectives (gradient allreduces and ``hvd.*`` collectives).
        nbytes: bytes of collective payload sent through the waits above.
        current: the kind of collective the rank is waiting in now; empty when none.
        kinds: the same figures per kind of collective (the timeline summary so far).
    """

    rank: int
    pid: int
    host: str
    clock_s: float
    steps: int
    wait_s: float
    nbytes: int
    current: str = ""
    kinds: dict[str, KindStats] = field(default_factory=dict)

    def encode(self) -> bytes:
        """JSON frame body."""
        data = {"rank": self.rank, "pid": self.pid, "host": self.host, "clock_s": self.clock_s, "steps": self.steps,
                "wait_s": self.wait_s, "bytes": self.nbytes, "current": self.current,
                "kinds": {k: [v.count, v.wait_s, v.nbytes] for k, v in self.kinds.items()}}
        return json.dumps(data, separators=(",", ":")).encode()

    @classmethod
    def decode(cls, body: bytes) -> RankStats:
        """Inverse of :meth:`encode`, checking every field.

        Raises:
            InvalidArgumentError: (a ValueError) the body is too large, not the record's JSON, or holds a
                field out of bounds.
        """
        if len(body) > MAX_BYTES:
            raise InvalidArgumentError(f"a stats record of {len(body)} bytes is over {MAX_BYTES}")
        data = json.loads(body)
        kinds = data["kinds"]
        if not isinstance(kinds, dict) or len(kinds) > MAX_KINDS:
            raise InvalidArgumentError("a stats record's kinds must be an object of at most 16 entries")
        return cls(
            rank=_count(data["rank"]), pid=_count(data["pid"]), host=_word(data["host"], allow_empty=False),
            clock_s=_seconds(data["clock_s"]), steps=_count(data["steps"]), wait_s=_seconds(data["wait_s"]),
            nbytes=_count(data["bytes"]), current=_word(data["current"], allow_empty=True),
            kinds={_word(k, allow_empty=False): KindStats(_count(v[0]), _seconds(v[1]), _count(v[2]))
                   for k, v in kinds.items()},
        )


def _count(value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise InvalidArgumentError(f"{value!r} is not a count")
    return value


def _seconds(value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise InvalidArgumentError(f"{value!r} is not a number of seconds")
    return float(value)


def _word(value: object, allow_empty: bool) -> str:
    if not isinstance(value, str) or not (_NAME.match(value) or (allow_empty and value == "")):
        raise InvalidArgumentError(f"{value!r} is not a short name")
    return value


# --- the rank's side: counters the instrumented code bumps, read by the reporter thread. Plain globals, no
# lock: each is written by the training thread only, and the reporter reads a slightly stale value at worst.
_on = False
_steps = 0
_wait_s = 0.0
_bytes = 0
_current = ""
_kinds: dict[str, list[float]] = {}
_reporter: _Reporter | None = None


def step() -> None:
    """One optimizer step was taken."""
    global _steps
    if _on:
        _steps += 1


def begin(kind: str) -> float:
    """The rank starts waiting for a collective of ``kind``; returns the start time for :func:`end` (0 when off)."""
    global _current
    if not _on:
        return 0.0
    _current = kind
    return time.perf_counter()


def end(kind: str, started: float, nbytes: int) -> None:
    """The wait :func:`begin` started is over; ``nbytes`` of payload went through it."""
    global _current, _wait_s, _bytes
    if not _on:
        return
    waited = time.perf_counter() - started
    _current = ""
    _wait_s += waited
    _bytes += nbytes
    entry = _kinds.get(kind)
    if entry is None:
        _kinds[kind] = [1, waited, nbytes]
    else:
        entry[0] += 1
        entry[1] += waited
        entry[2] += nbytes


def snapshot(rank: int, host: str) -> RankStats:
    """The counters now, as a record."""
    kinds = {k: KindStats(int(v[0]), v[1], int(v[2])) for k, v in list(_kinds.items())[:MAX_KINDS]}
    return RankStats(rank=rank, pid=os.getpid(), host=host, clock_s=time.monotonic(), steps=_steps,
                     wait_s=_wait_s, nbytes=_bytes, current=_current, kinds=kinds)


class _Reporter:
    """The thread that sends a record every interval while something changed, and once more at the end."""

    def __init__(self, send: Callable[[bytes], None], rank: int, host: str, interval_s: float) -> None:
        self._send, self._rank, self._host, self._interval = send, rank, host, interval_s
        self._stop = threading.Event()
        self._last: tuple[int, float, str] | None = None
        self._thread = threading.Thread(target=self._loop, name="phalanx-stats", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.wait(self._interval):
            self.flush(force=False)

    def flush(self, force: bool) -> None:
        """Send the counters if they changed since the last record (always when ``force``)."""
        state = (_steps, _wait_s, _current)
        if state == self._last and not force:
            return
        self._last = state
        try:
            self._send(snapshot(self._rank, self._host).encode())
        except OSError:  # ChannelError too: the channel is gone, the job is ending
            self._stop.set()

    def stop(self) -> None:
        """Send the last record and end the thread."""
        if not self._stop.is_set():
            self._stop.set()
            self.flush(force=True)


def start_reporter(send: Callable[[bytes], None], rank: int, host: str | None = None) -> bool:
    """Start counting and sending when ``PHALANX_STATS_INTERVAL_S`` asks for it; True when started.

    Args:
        send: sends one STATS frame body to the driver (the worker's channel).
        rank: this rank's channel id.
        host: the host to report (default: this machine's name).
    """
    global _on, _reporter, _steps, _wait_s, _bytes, _current, _kinds
    interval = settings.STATS_INTERVAL.get()
    if interval is None or _reporter is not None:
        return False
    _steps, _wait_s, _bytes, _current, _kinds = 0, 0.0, 0, "", {}
    _reporter = _Reporter(send, rank, host or socket.gethostname(), interval)
    _on = True
    return True


def stop_reporter() -> None:
    """Send the final record (before the rank's result, so the driver sees its last step) and stop."""
    global _on, _reporter
    if _reporter is not None:
        _reporter.stop()
    _on = False
    _reporter = None


def reporting() -> bool:
    """Whether this process counts and sends stats."""
    return _on


def ensure_reporter(rank: int, connect: Callable[[], Callable[[bytes], None]], host: str | None = None) -> None:
    """A command's rank: when stats are asked for and no reporter runs (a function job's worker starts its
    own), open a channel connection with ``connect`` and report on it until the process exits."""
    if _on or settings.STATS_INTERVAL.get() is None:
        return
    try:
        send = connect()
    except OSError as e:  # ChannelError too: the page misses this rank, the job runs on
        logging.getLogger(__name__).warning("phalanx: rank %d cannot send stats to the driver: %s", rank, e)
        return
    if start_reporter(send, rank, host):
        atexit.register(stop_reporter)
