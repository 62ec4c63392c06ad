"""Cost of watching a job: training steps with the job page open and /metrics scraped every second, vs off.

Jobs alternate off / on (``phalanx.run(..., dashboard=True)``), so a change in the machine's load hits
both alike. In an "on" job a client on the driver holds the page's event stream open (as a browser does)
and scrapes ``/metrics`` every second. Each job (2 ranks) trains phalanx.torch's training benchmark MLP
(``bench/train.py``) with ``hvd.DistributedOptimizer``; rank 0 reports its steps/s and both ranks' CPU
seconds per step (all threads: the stats reporter's too). The driver's CPU seconds per second of the job are
measured too. Each pair (off, on) gives a paired ratio; the figure is the median.

Then the driver's memory: a fresh driver runs ``bench/driver_memory.py``'s 500k-short-lines job with the page
open and scraped, and without; the printed figure is the peak RSS difference.

    .venv/bin/python bench/dashboard.py [--pairs 4] [--steps 300]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from typing import Any

import phalanx


def _model() -> tuple[Any, tuple[int, ...]]:
    import cloudpickle

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import train

    cloudpickle.register_pickle_by_value(train)
    return train.MODELS["mlp"]


def _train(make: Any, shape: tuple[int, ...], steps: int) -> dict[str, float]:
    import torch

    import phalanx.torch as hvd

    hvd.init()
    torch.manual_seed(0)
    model = make()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                                   named_parameters=model.named_parameters())
    x, y = torch.randn(*shape), torch.randint(0, 10, (shape[0],))
    loss_fn = torch.nn.CrossEntropyLoss()

    def step() -> None:
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        opt.step()

    for _ in range(20):
        step()
    hvd.allreduce(torch.zeros(1), name="bench.sync")
    t0, c0 = time.perf_counter(), time.process_time()
    for _ in range(steps):
        step()
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    cpus = hvd.allgather_object(cpu / steps)
    return {"steps_per_s": steps / wall, "cpu_per_step": sum(cpus)}


class _Page:
    """What a browser with the page open does, plus a Prometheus scraper: in threads of the driver."""

    def __init__(self) -> None:
        self.stop = threading.Event()
        self.events = 0
        self.scrapes = 0
        threading.Thread(target=self._run, daemon=True).start()

    def _server(self) -> Any:
        from phalanx.observe import server

        while not self.stop.is_set():
            for page in list(server._SERVERS.values()):
                if page.board is not None and page.board.ended is None:
                    return page
            time.sleep(0.05)
        return None

    def _run(self) -> None:
        page = self._server()
        if page is None:
            return
        threading.Thread(target=self._stream, args=(page.url.replace("/?", "/events?"),), daemon=True).start()
        metrics = page.url.replace("/?", "/metrics?")
        while not self.stop.wait(1.0):
            urllib.request.urlopen(metrics, timeout=10).read()
            self.scrapes += 1

    def _stream(self, url: str) -> None:
        with urllib.request.urlopen(url, timeout=30) as stream:
            while not self.stop.is_set():
                if stream.readline().startswith(b"data: "):
                    self.events += 1


def _job(on: bool, steps: int) -> dict[str, float]:
    make, shape = _model()
    page = _Page() if on else None
    c0, t0 = time.process_time(), time.perf_counter()
    try:
        result = phalanx.run(_train, args=(make, shape, steps), np=2, dashboard=on)[0]
    finally:
        if page is not None:
            page.stop.set()
    result["driver_cpu_per_s"] = (time.process_time() - c0) / (time.perf_counter() - t0)
    if page is not None:
        result["events"], result["scrapes"] = page.events, page.scrapes
    return result


MEMORY_DRIVER = """
import resource, sys, threading, time, urllib.request
sys.path.insert(0, {bench!r})
import phalanx
from dashboard import _Page
page = _Page() if {on} else None
phalanx.run(lambda: [print(f'line {{i}}') for i in range(500_000)] and None, np=2, start_timeout=300, dashboard={on})
print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, file=sys.stderr)
"""


def _peak_mib(on: bool) -> float:
    code = MEMORY_DRIVER.format(bench=os.path.dirname(os.path.abspath(__file__)), on=on)
    done = subprocess.run([sys.executable, "-c", code], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                          check=True, timeout=900)
    return int(done.stderr.strip().splitlines()[-1]) / 1024


def _counting_us() -> float:
    """Microseconds a rank spends per step counting (one step and two collective waits) with stats on."""
    from phalanx.job import stats

    stats._on = True
    n = 200_000
    t0 = time.perf_counter()
    for _ in range(n):
        stats.step()
        stats.end("allreduce", stats.begin("allreduce"), 4096)
        stats.end("optimizer step", stats.begin("optimizer step"), 8)
    stats._on = False
    return (time.perf_counter() - t0) / n * 1e6


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=4)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--skip-memory", action="store_true")
    ns = parser.parse_args()
    runs: dict[bool, list[dict[str, float]]] = {False: [], True: []}
    for i in range(ns.pairs):
        for on in (False, True) if i % 2 == 0 else (True, False):
            runs[on].append(_job(on, ns.steps))
        off, on_ = runs[False][-1], runs[True][-1]
        print(f"pair {i}: off {off['steps_per_s']:.2f} steps/s, on {on_['steps_per_s']:.2f} steps/s "
              f"({on_['events']} page updates, {on_['scrapes']} scrapes)", flush=True)
    wall = statistics.median(off["steps_per_s"] / on["steps_per_s"] for off, on in zip(runs[False], runs[True]))
    cpu = statistics.median(on["cpu_per_step"] / off["cpu_per_step"] for off, on in zip(runs[False], runs[True]))
    med = {k: {m: statistics.median(r[m] for r in v) for m in ("steps_per_s", "cpu_per_step", "driver_cpu_per_s")}
           for k, v in runs.items()}
    print(json.dumps({"off": med[False], "on": med[True]}, indent=1))
    print(f"training step, page open + /metrics every second vs off: wall {100 * (wall - 1):+.2f} %, "
          f"ranks' CPU per step {100 * (cpu - 1):+.2f} % (median of {ns.pairs} interleaved pairs)")
    counting = _counting_us()
    print(f"counting per step: {counting:.2f} us = {100 * counting * 1e-6 / med[False]['cpu_per_step'] * 2:.4f} % "
          "of the ranks' CPU per step")
    print(f"driver CPU: {100 * med[True]['driver_cpu_per_s']:.1f} % of a core on vs "
          f"{100 * med[False]['driver_cpu_per_s']:.1f} % off")
    if not ns.skip_memory:
        off_mib, on_mib = _peak_mib(False), _peak_mib(True)
        print(f"driver peak RSS, 500k short lines: {off_mib:.0f} MiB off, {on_mib:.0f} MiB with the page "
              f"({on_mib - off_mib:+.0f} MiB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
