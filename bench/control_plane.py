"""The driver's control plane against many simulated ranks: formation, log streaming, failure verdict.

The driver side is the real one, wired as a hosts job wires it: a :class:`DriverChannel`, a
:class:`JobMonitor` whose custom events go to :class:`ExitReports`, a counting log sink. Each simulated
rank is the real client side of a host agent's supervisor: a :class:`WorkerChannel` connected as
``Role.SUPERVISOR`` that says hello, forwards its rank's output as ``LOG`` frames, sends a heartbeat every
second and, when its rank ends, the exit event. The ranks live as threads in a few simulation processes
(no torch, no rank processes: only the control plane is measured).

A run: every rank connects; formation is the time from the last rank's connection to the monitor having
seen every hello. Every rank then logs ``--rate`` lines/s for ``--seconds``; the driver's CPU and peak RSS
are measured over that phase. Once every line is sent, one rank's (simulated) process is killed: its
supervisor reports exit -9, as a host agent does, and the verdict time is from the kill to the monitor
stopping the job. Every line is numbered; the sink checks that each rank's lines all arrived, in order.

There is no competitor: torchrun's agent reads neither the ranks' output nor their results.

    .venv/bin/python bench/control_plane.py [--ranks 128,256,1024] [--procs 4] [--json]
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import resource
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import Any

from phalanx.errors import WorkerFailedError
from phalanx.job.channel import Custom, DriverChannel, Role, WorkerChannel
from phalanx.job.framing import Kind
from phalanx.job.monitor import JobMonitor, MonitorConfig
from phalanx.job.observation import RankStarted
from phalanx.job.records import Hello, LogLine, Stream
from phalanx.launch.supervisor import HEARTBEAT, ExitReports, exit_event

SECRET_VAR = "PHALANX_BENCH_CHANNEL_SECRET"
CONNECT_TIMEOUT_S = 120.0
CONNECTORS = 16  # connecting threads per simulation process


# ----------------------------------------------------------------------------------------- simulated ranks

def _say(obj: dict[str, object]) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def simulate(address: str, ranks: range, rate: float, seconds: float) -> None:
    """One simulation process: connect ``ranks``' supervisors, then obey the driver's commands on stdin."""
    secret = os.environ[SECRET_VAR]

    def connect(rank: int) -> tuple[int, WorkerChannel, float]:
        channel = WorkerChannel.connect(address, secret, rank, Role.SUPERVISOR, CONNECT_TIMEOUT_S)
        connected = time.monotonic()
        channel.send(Kind.HELLO, Hello(rank=rank, pid=os.getpid(), host="sim").encode())
        return rank, channel, connected

    with ThreadPoolExecutor(CONNECTORS) as pool:
        done = list(pool.map(connect, ranks))
    channels = {rank: channel for rank, channel, _ in done}
    _say({"connected_at": max(t for _, _, t in done)})
    sent = dict.fromkeys(channels, 0)
    for command in sys.stdin:
        verb, _, arg = command.strip().partition(" ")
        if verb == "log":
            _stream(channels, sent, rate, seconds)
            _say({"sent": sent})
        elif verb == "kill":  # the rank's process died by SIGKILL: its supervisor reports it at once
            rank = int(arg)
            channels.pop(rank).send(Kind.EVENT, exit_event(-9))
        elif verb == "stop":  # the driver stopped the job: every other rank ends by SIGTERM
            for channel in channels.values():
                channel.send(Kind.EVENT, exit_event(-15))
                channel.close()
            return


def _stream(channels: dict[int, WorkerChannel], sent: dict[int, int], rate: float, seconds: float) -> None:
    """Every rank sends ``rate`` numbered lines a second for ``seconds`` (and a heartbeat a second)."""
    start = time.monotonic()
    beats = 0
    while (now := time.monotonic()) - start < seconds:
        due = int((now - start) * rate) + 1
        for rank, channel in channels.items():
            for seq in range(sent[rank], due):
                channel.send(Kind.LOG, LogLine(rank, Stream.STDOUT, f"rank {rank} line {seq}").encode())
            sent[rank] = max(sent[rank], due)
        if now - start >= beats:
            beats += 1
            for channel in channels.values():
                channel.send(Kind.EVENT, HEARTBEAT)
        time.sleep(max(0.0, start + due / rate - time.monotonic()))


# ----------------------------------------------------------------------------------------- the driver side

@dataclass
class CountingSink:
    """A log sink that checks each rank's numbered lines arrive whole and in order."""

    counts: list[int]
    out_of_order: int = 0

    def write(self, line: LogLine) -> None:
        seq = int(line.text.rsplit(" ", 1)[1])
        if seq != self.counts[line.rank]:
            self.out_of_order += 1
        self.counts[line.rank] = seq + 1

    def flush(self) -> None:
        pass


@dataclass
class Figures:
    ranks: int
    procs: int
    formation_s: float = float("nan")
    lines_sent: int = 0
    lines_received: int = 0
    out_of_order: int = 0
    log_seconds: float = 0.0
    driver_cpu_cores: float = float("nan")
    driver_peak_rss_mb: float = float("nan")
    driver_threads: int = 0
    verdict_s: float = float("nan")
    root_cause_rank: int | None = None
    killed_rank: int = 0
    errors: list[str] = field(default_factory=list)


def _cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _peak_rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return float("nan")


class Driver:
    """One measured run: the real driver objects and the simulation processes around them."""

    def __init__(self, ranks: int, procs: int, rate: float, seconds: float) -> None:
        self.fig = Figures(ranks=ranks, procs=procs, killed_rank=ranks // 2)
        self.rate, self.seconds = rate, seconds
        self.channel = DriverChannel(ranks, b"")
        self.exits = ExitReports(function_job=False)
        self.exits.attach(self.channel)
        self.sink = CountingSink([0] * ranks)
        self.hellos = 0
        self.formed = threading.Event()
        self.formed_at = 0.0
        self.stopped_at: float | None = None
        config = MonitorConfig(world_size=ranks, expect_results=False, expect_hello=True,
                               start_timeout_s=CONNECT_TIMEOUT_S, start_timeout_hint="--ranks",
                               stop_wait_s=30.0)
        self.monitor = JobMonitor(config, self.channel.events, [self.sink], stop_all=self._stop_all,
                                  on_custom=self._on_custom, observer=self._observe)
        self.sims: list[subprocess.Popen[str]] = []

    def _on_custom(self, event: Custom) -> None:
        if event.body != HEARTBEAT:
            self.exits.on_event(event)

    def _observe(self, event: object) -> None:
        if isinstance(event, RankStarted):
            self.hellos += 1
            if self.hellos == self.fig.ranks:
                self.formed_at = time.monotonic()
                self.formed.set()

    def _stop_all(self) -> None:
        if self.stopped_at is None:
            self.stopped_at = time.monotonic()
            for sim in self.sims:
                self._tell(sim, "stop")

    @staticmethod
    def _tell(sim: subprocess.Popen[str], command: str) -> None:
        assert sim.stdin is not None
        try:
            sim.stdin.write(command + "\n")
            sim.stdin.flush()
        except (BrokenPipeError, OSError):
            pass

    @staticmethod
    def _hear(sim: subprocess.Popen[str]) -> dict[str, Any]:
        assert sim.stdout is not None
        line = sim.stdout.readline()
        if not line:
            raise RuntimeError(f"simulation process {sim.pid} ended early (exit {sim.wait()})")
        decoded: dict[str, Any] = json.loads(line)
        return decoded

    def run(self) -> Figures:
        threading.Thread(target=self._script, name="bench-script", daemon=True).start()
        try:
            self.monitor.run()
            self.fig.errors.append("the monitor reported no failure")
        except WorkerFailedError as e:
            self.fig.root_cause_rank = e.failures[0].rank if e.failures else None
            if self.stopped_at is not None and self._killed_at:
                self.fig.verdict_s = self.stopped_at - self._killed_at
        finally:
            for sim in self.sims:
                try:
                    sim.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    sim.kill()
                    sim.wait()
            self.channel.close()
        self.fig.lines_received = sum(self.sink.counts)
        self.fig.out_of_order = self.sink.out_of_order
        return self.fig

    _killed_at = 0.0

    def _script(self) -> None:
        """Start the simulated ranks, wait for formation, stream logs, kill one rank."""
        try:
            self._start_sims()
            connected = max(float(self._hear(sim)["connected_at"]) for sim in self.sims)
            if not self.formed.wait(CONNECT_TIMEOUT_S):
                raise RuntimeError(f"only {self.hellos} of {self.fig.ranks} hellos in {CONNECT_TIMEOUT_S} s")
            self.fig.formation_s = max(0.0, self.formed_at - connected)
            self.fig.driver_threads = threading.active_count()
            cpu0, wall0 = _cpu_s(), time.monotonic()
            for sim in self.sims:
                self._tell(sim, "log")
            sent: dict[str, int] = {}
            for sim in self.sims:
                sent.update(self._hear(sim)["sent"])
            self.fig.lines_sent = sum(sent.values())
            self._await_lines(self.fig.lines_sent)
            self.fig.log_seconds = time.monotonic() - wall0
            self.fig.driver_cpu_cores = (_cpu_s() - cpu0) / self.fig.log_seconds
            self.fig.driver_peak_rss_mb = _peak_rss_mb()
            owner = self.sims[self.fig.killed_rank * len(self.sims) // self.fig.ranks]
            self._killed_at = time.monotonic()
            self._tell(owner, f"kill {self.fig.killed_rank}")
        except Exception as e:  # the monitor's start timeout then ends the run; the error is reported
            self.fig.errors.append(f"{type(e).__name__}: {e}")
            self._stop_all()

    def _await_lines(self, total: int, timeout_s: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_s
        while sum(self.sink.counts) < total:
            if time.monotonic() > deadline:
                raise RuntimeError(f"{sum(self.sink.counts)} of {total} lines arrived within {timeout_s} s")
            time.sleep(0.01)

    def _start_sims(self) -> None:
        n, procs = self.fig.ranks, self.fig.procs
        env = {**os.environ, SECRET_VAR: self.channel.secret}
        for i in range(procs):
            lo, hi = i * n // procs, (i + 1) * n // procs
            argv = [sys.executable, __file__, "--simulate", self.channel.address, str(lo), str(hi),
                    str(self.rate), str(self.seconds)]
            self.sims.append(subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                              env=env))


def measure(ranks: int, procs: int, rate: float, seconds: float) -> Figures:
    return Driver(ranks, procs, rate, seconds).run()


def _table(rows: list[Figures]) -> str:
    head = ("| ranks | formation | lines sent / received | lost | log phase (driver lines/s) | driver CPU | "
            "driver peak RSS | driver threads | kill to verdict | root cause |")
    out = [head, "|" + "---|" * 10]
    for f in rows:
        lost = f.lines_sent - f.lines_received + f.out_of_order
        rate = f.lines_received / f.log_seconds if f.log_seconds else float("nan")
        out.append(f"| {f.ranks} | {f.formation_s * 1e3:.1f} ms | {f.lines_sent} / {f.lines_received} | {lost} | "
                   f"{f.log_seconds:.1f} s ({rate:.0f}) | {f.driver_cpu_cores:.2f} cores | "
                   f"{f.driver_peak_rss_mb:.0f} MB | {f.driver_threads} | {f.verdict_s * 1e3:.1f} ms | "
                   f"rank {f.root_cause_rank} (killed {f.killed_rank}) |")
    return "\n".join(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", default="128,256,1024", help="comma-separated rank counts")
    parser.add_argument("--procs", type=int, default=4, help="simulation processes")
    parser.add_argument("--rate", type=float, default=100.0, help="log lines per second per rank")
    parser.add_argument("--seconds", type=float, default=3.0, help="seconds of logging")
    parser.add_argument("--json", action="store_true", help="print one JSON object per run, no table")
    parser.add_argument("--simulate", nargs=5, metavar=("ADDRESS", "LO", "HI", "RATE", "SECONDS"),
                        help=argparse.SUPPRESS)
    args = parser.parse_args()
    faulthandler.register(10)  # SIGUSR1: every thread's stack, to see where a large run spends its time
    if args.simulate:
        address, lo, hi, rate, seconds = args.simulate
        simulate(address, range(int(lo), int(hi)), float(rate), float(seconds))
        return
    load = os.getloadavg()
    rows = []
    for n in (int(x) for x in args.ranks.split(",")):
        # each size in a fresh driver process: a process's peak RSS only grows
        if len(args.ranks.split(",")) > 1:
            argv = [sys.executable, __file__, "--ranks", str(n), "--procs", str(args.procs), "--rate",
                    str(args.rate), "--seconds", str(args.seconds), "--json"]
            row = Figures(**json.loads(subprocess.run(argv, check=True, capture_output=True, text=True).stdout))
        else:
            row = measure(n, args.procs, args.rate, args.seconds)
        if args.json:
            print(json.dumps(asdict(row)), flush=True)
        else:
            print(f"{n} ranks: done", file=sys.stderr, flush=True)
        rows.append(row)
    if not args.json:
        print(f"load average (1, 5, 15 min) before: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")
        print(_table(rows))
        for f in rows:
            for err in f.errors:
                print(f"{f.ranks} ranks: {err}")


if __name__ == "__main__":
    main()
