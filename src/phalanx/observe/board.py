"""The job's state as the page and the metrics show it, kept from the monitor's observations.

:meth:`JobBoard.observe` runs in the monitor's thread for every observation: it takes a lock, updates a
few fields and returns (no I/O). Everything it keeps is bounded: per rank the last :data:`LOG_LINES` lines
(each cut at :data:`LINE_CHARS`) and :data:`HISTORY` rate samples; the job's last :data:`EVENTS` events
and a failure report of at most :data:`REPORT_CHARS`. Readers (the page's stream, ``/metrics``, MLflow)
take :meth:`snapshot` (a plain dict, built at most once per change) or :meth:`json`.
"""

from __future__ import annotations

import json
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from phalanx.job.observation import JobEnded, Observation, RankEnded, RankStarted, Reformed
from phalanx.job.records import LogLine
from phalanx.job.stats import RankStats

LOG_LINES = 40
LINE_CHARS = 400
HISTORY = 60
EVENTS = 100
REPORT_CHARS = 64_000
#: A rank whose share of time spent waiting in collectives is this much below the most waiting rank's is the
#: straggler (the others wait for it).
STRAGGLER_GAP = 0.1


@dataclass
class RankView:
    """One rank's row."""

    rank: int
    state: str = "starting"
    host: str = ""
    pid: int = 0
    start_latency_s: float | None = None
    steps: int = 0
    steps_per_s: float = 0.0
    step_s: float = 0.0
    wait_s: float = 0.0
    wait_share: float = 0.0
    nbytes: int = 0
    current: str = ""
    cause: str = ""
    returncode: int | None = None
    trend: deque[float] = field(default_factory=lambda: deque(maxlen=HISTORY))
    logs: deque[tuple[int, str]] = field(default_factory=lambda: deque(maxlen=LOG_LINES))
    kinds: dict[str, tuple[int, float, int]] = field(default_factory=dict)
    last: RankStats | None = None

    def public(self) -> dict[str, Any]:
        """The row as the page reads it."""
        return {"rank": self.rank, "state": self.state, "host": self.host, "pid": self.pid,
                "start_latency_s": self.start_latency_s, "steps": self.steps, "steps_per_s": self.steps_per_s,
                "step_s": self.step_s, "wait_s": self.wait_s, "wait_share": self.wait_share, "bytes": self.nbytes,
                "current": self.current, "cause": self.cause, "returncode": self.returncode,
                "trend": list(self.trend), "logs": list(self.logs)}


class JobBoard:
    """What is known of one job; see the module docstring. Thread-safe."""

    def __init__(self, run_id: str, world_size: int, kind: str = "job") -> None:
        self.run_id = run_id
        self.world_size = world_size
        self.kind = kind
        self.started = time.monotonic()
        self.started_wall = time.time()
        self.resets = 0
        self.ended: JobEnded | None = None
        self.ended_s: float | None = None
        self._ranks: dict[int, RankView] = {r: RankView(r) for r in range(world_size)}
        self._events: deque[tuple[float, str]] = deque(maxlen=EVENTS)
        self._lock = threading.Lock()
        self.version = 0
        self._cached: tuple[int, bytes] = (-1, b"")

    def observe(self, obs: Observation) -> None:
        """Take one observation from the monitor (its thread; returns at once)."""
        with self._lock:
            self.version += 1
            if isinstance(obs, LogLine):
                self._rank(obs.rank).logs.append((int(obs.stream), obs.text[:LINE_CHARS]))
            elif isinstance(obs, RankStats):
                self._stats(obs)
            elif isinstance(obs, RankStarted):
                self._started(obs.rank, obs.pid, obs.host, obs.at)
            elif isinstance(obs, RankEnded):
                self._ended(obs)
            elif isinstance(obs, Reformed):
                self.resets = obs.resets
                for worker in obs.world:  # replacements show as starting until they say hello
                    self._rank(worker)
                self._event(f"world re-formed (#{obs.resets}): workers {list(obs.world)}")
            elif isinstance(obs, JobEnded):
                self.ended = JobEnded(obs.ok, obs.report[:REPORT_CHARS], tuple(obs.ranks))
                self.ended_s = time.monotonic() - self.started
                self._event("job succeeded" if obs.ok else "job failed")

    def _rank(self, rank: int) -> RankView:
        view = self._ranks.get(rank)
        if view is None:  # an elastic job's replacement worker
            view = self._ranks[rank] = RankView(rank)
        return view

    def _event(self, text: str) -> None:
        self._events.append((round(time.monotonic() - self.started, 3), text))

    def _started(self, rank: int, pid: int, host: str, at: float) -> None:
        view = self._rank(rank)
        view.pid, view.host = pid, host
        if view.start_latency_s is None:
            view.start_latency_s = max(0.0, at - self.started)
        if view.state == "starting":
            view.state = "running"

    def _stats(self, rec: RankStats) -> None:
        view = self._rank(rec.rank)
        if view.state == "starting" or not view.host:  # a command's rank has no hello: its first record is one
            self._started(rec.rank, rec.pid, rec.host, time.monotonic())
        prev = view.last
        if prev is not None and rec.clock_s > prev.clock_s:
            span = rec.clock_s - prev.clock_s
            done = rec.steps - prev.steps
            view.steps_per_s = done / span
            view.step_s = span / done if done > 0 else view.step_s
            view.wait_share = min(1.0, (rec.wait_s - prev.wait_s) / span)
            view.trend.append(round(view.steps_per_s, 3))
        view.last = rec
        view.steps, view.wait_s, view.nbytes, view.current = rec.steps, rec.wait_s, rec.nbytes, rec.current
        view.kinds = {k: (v.count, v.wait_s, v.nbytes) for k, v in rec.kinds.items()}
        if view.state in ("running", "collective"):
            view.state = "collective" if rec.current else "running"

    def _ended(self, obs: RankEnded) -> None:
        view = self._rank(obs.rank)
        view.returncode, view.current = obs.returncode, ""
        if not obs.failed:
            view.state = "finished"
        elif obs.stopped:
            view.state, view.cause = "stopped", obs.cause
        else:
            view.state, view.cause = "failed", obs.cause
            self._event(f"rank {obs.rank} failed: {obs.cause}")

    def row(self, rank: int) -> dict[str, Any]:
        """One rank's row (see :meth:`RankView.public`)."""
        with self._lock:
            return self._rank(rank).public()

    def alive(self) -> int:
        """Ranks started and not ended."""
        with self._lock:
            return sum(v.state in ("running", "collective") for v in self._ranks.values())

    def snapshot(self) -> dict[str, Any]:
        """The whole board as plain data (see :meth:`json`)."""
        with self._lock:
            return self._snapshot()

    def _snapshot(self) -> dict[str, Any]:
        ranks = [self._ranks[r].public() for r in sorted(self._ranks)]
        straggler = _straggler(list(self._ranks.values()))
        latencies = [v.start_latency_s for v in self._ranks.values() if v.start_latency_s is not None]
        return {
            "run_id": self.run_id, "kind": self.kind, "world_size": self.world_size, "version": self.version,
            "uptime_s": round(time.monotonic() - self.started, 3), "started_wall": self.started_wall,
            "resets": self.resets, "straggler": straggler,
            "start_latency_s": max(latencies) if len(latencies) >= self.world_size else None,
            "alive": sum(v.state in ("running", "collective") for v in self._ranks.values()),
            "ranks": ranks, "summary": self._summary(), "events": list(self._events),
            "end": None if self.ended is None else {"ok": self.ended.ok, "report": self.ended.report,
                                                    "after_s": self.ended_s},
        }

    def _summary(self) -> list[dict[str, Any]]:
        """The timeline summary so far: per kind of collective, over every rank."""
        total: dict[str, list[float]] = {}
        for view in self._ranks.values():
            for kind, (count, wait, nbytes) in view.kinds.items():
                row = total.setdefault(kind, [0, 0.0, 0, 0])
                row[0] += count
                row[1] += wait
                row[2] += nbytes
                row[3] += 1
        return [{"kind": k, "count": int(c), "wait_s": w, "bytes": int(b), "ranks": int(n),
                 "mean_wait_ms": 1000.0 * w / c if c else 0.0} for k, (c, w, b, n) in sorted(total.items())]

    def json(self) -> tuple[int, bytes]:
        """``(version, the snapshot as JSON)``, built once per version however many readers ask."""
        with self._lock:
            if self._cached[0] != self.version:
                self._cached = (self.version, json.dumps(self._snapshot(), separators=(",", ":")).encode())
            return self._cached


def _straggler(views: list[RankView]) -> int | None:
    """The running rank the others wait for: the least share of its time waiting in collectives, when it
    waits clearly less than the most waiting rank (None otherwise, or with fewer than two such ranks)."""
    live = [v for v in views if v.state in ("running", "collective") and v.last is not None]
    if len(live) < 2:
        return None
    least = min(live, key=lambda v: v.wait_share)
    most = max(v.wait_share for v in live)
    return least.rank if most - least.wait_share >= STRAGGLER_GAP else None
