"""``/metrics``: the job board in Prometheus' text format, through ``prometheus_client`` (``phalanx[observe]``).

One collector reads the board at scrape time (nothing is kept twice), in a registry of its own (the
process's default registry is left to the user). Names follow Prometheus' conventions: a ``phalanx_``
prefix, base units (seconds, bytes), ``_total`` on counters; every series carries the job's id as ``job_id``
(``job`` and ``instance`` are the scraper's own labels). docs/observe.md lists them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

#: The content type of the text format (prometheus_client's, when it is installed).
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
MISSING = "prometheus_client is not installed on the driver: pip install 'phalanx[observe]' (or prometheus_client)\n"


def available() -> bool:
    """Whether ``prometheus_client`` can be imported."""
    try:
        import prometheus_client  # noqa: F401
    except ImportError:
        return False
    return True


def render(snapshot: Callable[[], dict[str, Any]]) -> bytes:
    """The text exposition of the board ``snapshot()`` returns (read once per scrape).

    Raises:
        ImportError: prometheus_client is missing (the server answers 501 with :data:`MISSING`).
    """
    from prometheus_client import CollectorRegistry, generate_latest

    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Collector(snapshot))
    return generate_latest(registry)


class _Collector:
    def __init__(self, snapshot: Callable[[], dict[str, Any]]) -> None:
        self._snapshot = snapshot

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        snap = self._snapshot()
        job = [snap["run_id"]]
        per_rank = ["job_id", "rank", "host"]

        def gauge(name: str, doc: str, labels: list[str]) -> GaugeMetricFamily:
            return GaugeMetricFamily(name, doc, labels=labels)

        def counter(name: str, doc: str, labels: list[str]) -> CounterMetricFamily:
            return CounterMetricFamily(name, doc, labels=labels)

        steps = counter("phalanx_rank_steps", "Optimizer steps the rank took", per_rank)
        step_s = gauge("phalanx_rank_step_seconds", "Seconds per optimizer step over the last interval", per_rank)
        wait = counter("phalanx_rank_collective_wait_seconds", "Seconds the rank waited in collectives", per_rank)
        nbytes = counter("phalanx_rank_reduced_bytes", "Bytes of collective payload the rank sent", per_rank)
        up = gauge("phalanx_rank_up", "1 while the rank runs, 0 before it started or after it ended", per_rank)
        latency = gauge("phalanx_rank_start_latency_seconds", "Seconds from the job's start to the rank's hello",
                        per_rank)
        for r in snap["ranks"]:
            labels = [*job, str(r["rank"]), r["host"]]
            steps.add_metric(labels, r["steps"])
            step_s.add_metric(labels, r["step_s"])
            wait.add_metric(labels, r["wait_s"])
            nbytes.add_metric(labels, r["bytes"])
            up.add_metric(labels, 1.0 if r["state"] in ("running", "collective") else 0.0)
            if r["start_latency_s"] is not None:
                latency.add_metric(labels, r["start_latency_s"])
        yield from (steps, step_s, wait, nbytes, up, latency)
        yield from _job_metrics(snap, job)


def _job_metrics(snap: dict[str, Any], job: list[str]) -> Iterator[Any]:
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    ranks = snap["ranks"]
    running = [r for r in ranks if r["state"] in ("running", "collective")]
    values = [
        (GaugeMetricFamily, "phalanx_job_ranks_alive", "Ranks running now", len(running)),
        (GaugeMetricFamily, "phalanx_job_ranks", "Ranks in the job's (first) world", snap["world_size"]),
        (CounterMetricFamily, "phalanx_job_reformations", "Times an elastic job re-formed its world", snap["resets"]),
        (GaugeMetricFamily, "phalanx_job_step_seconds", "Seconds per step of the slowest running rank",
         max((r["step_s"] for r in running), default=0.0)),
        (CounterMetricFamily, "phalanx_job_collective_wait_seconds", "Seconds every rank waited in collectives",
         sum(r["wait_s"] for r in ranks)),
        (CounterMetricFamily, "phalanx_job_reduced_bytes", "Bytes of collective payload every rank sent",
         sum(r["bytes"] for r in ranks)),
        (GaugeMetricFamily, "phalanx_job_up", "1 while the job runs, 0 once it is judged", 0 if snap["end"] else 1),
    ]
    if snap["start_latency_s"] is not None:
        values.append((GaugeMetricFamily, "phalanx_job_start_latency_seconds",
                       "Seconds from the job's start until every rank of its first world said hello",
                       snap["start_latency_s"]))
    for family, name, doc, value in values:
        metric = family(name, doc, labels=["job_id"])
        metric.add_metric(job, value)
        yield metric
