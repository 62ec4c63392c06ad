"""How the launch benchmarks time their jobs (shared by bench/launch.py and bench/spark_launch.py)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable


def timed(fn: Callable[[], None]) -> float:
    """Seconds one call of ``fn`` takes."""
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def median_time(fn: Callable[[], None], runs: int) -> tuple[float, list[float]]:
    """Median and every time of ``runs`` calls."""
    times = [timed(fn) for _ in range(runs)]
    return statistics.median(times), times
