"""How the benchmarks time their jobs (shared by bench/launch.py, spark_launch.py, data.py and estimator.py)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any


def timed(fn: Callable[[], None]) -> float:
    """Seconds one call of ``fn`` takes."""
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def median_time(fn: Callable[[], None], runs: int) -> tuple[float, list[float]]:
    """Median and every time of ``runs`` calls."""
    times = [timed(fn) for _ in range(runs)]
    return statistics.median(times), times


def slowest_at_once(target: Callable[..., None], shares: list[list[str]], args: tuple[Any, ...],
                    timeout_s: float) -> Any:
    """The smallest result of ``target(share, *args, barrier, out)`` run in one spawned process per share, all
    at once: each puts its result on ``out``, and the barrier lines their timed parts up."""
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    barrier, out = ctx.Barrier(len(shares)), ctx.Queue()
    workers = [ctx.Process(target=target, args=(share, *args, barrier, out)) for share in shares]
    for w in workers:
        w.start()
    results = [out.get(timeout=timeout_s) for _ in workers]
    for w in workers:
        w.join(timeout=60)
    return min(results)
