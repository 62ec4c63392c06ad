"""The driver's control plane against many simulated ranks: formation, log streaming, failure verdict,
elastic re-formation.

The driver side is the real one, wired as a hosts job wires it: a :class:`DriverChannel`, a
:class:`JobMonitor` (``--elastic``: an :class:`ElasticMonitor` and the job's :class:`RendezvousStore`) whose
custom events go to :class:`ExitReports`, a counting log sink. Each simulated rank is the real client side of
a host agent's supervisor: a :class:`WorkerChannel` connected as ``Role.SUPERVISOR`` that says hello, forwards
its rank's output as ``LOG`` frames (one frame per line), sends a heartbeat every second and, when its rank
ends, the exit event. The ranks live as threads in a few simulation processes (no torch, no rank
processes: only the control plane is measured). A simulation process writes the lines one rank has due in
one ``sendall`` (still one frame per line): one thread per process could not otherwise offer 100 lines/s
for each of 256 ranks on a loaded 2-core host; the driver reads and judges every frame as it would from
separate supervisors.

A run: every rank connects; formation is the time from the last rank's connection to the monitor having
seen every hello. Every rank then logs ``--rate`` lines/s for ``--seconds``; the driver's CPU and peak RSS
are measured over that phase, and its lag is the time from the last line sent to the last line received.
Every line is numbered; the sink checks that each rank's lines all arrived, in order. Then:

* by default one rank's (simulated) process is killed: its supervisor reports exit -9, as a host agent
  does, and the verdict time is from the kill to the monitor stopping the job, naming that rank;
* with ``--elastic K``, K ranks spread over the world are lost one after the other, the world re-formed
  after each (a loss while the last re-formation is still under way would make the sequence of rounds
  depend on timing, where each must be measured whole). Each rank also holds a store
  connection (the store's own protocol, as ``StoreClient`` speaks it; no torch) and, when the loss is
  noticed (a real survivor's collective fails; here the bench tells the survivors at the kill), waits for
  the next round as ``phalanx.torch.elastic`` does: ``wait`` for the round key, ``get`` the latest round
  and its assignment, then a store barrier of the new world (``add`` then ``wait``, c10d's store-based
  barrier). Timed from the kill: every loss reported to the monitor, the round published (the monitor's
  re-formation), every survivor through the new world's barrier. The survivors then end with exit 0 and
  the job must succeed.

There is no competitor: torchrun's agent reads neither the ranks' output nor their results.

    .venv/bin/python bench/control_plane.py [--ranks 128,256,1024] [--procs 4] [--elastic K] [--json]
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import resource
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import Any

from phalanx.env import rounds as elastic_keys
from phalanx.errors import WorkerFailedError
from phalanx.job import handshake
from phalanx.job.channel import Custom, DriverChannel, Role, WorkerChannel
from phalanx.job.elastic_policy import ElasticMonitor, ElasticPolicy
from phalanx.job.framing import FrameWriter, Kind, encode, read_frame
from phalanx.job.monitor import JobMonitor, MonitorConfig
from phalanx.job.observation import RankEnded, RankStarted, Reformed
from phalanx.job.records import Hello, LogLine, Stream
from phalanx.job.store import Op, Status, pack, unpack
from phalanx.launch.elasticity import publish_round
from phalanx.launch.rendezvous import RendezvousStore
from phalanx.launch.supervisor import HEARTBEAT, ExitReports, exit_event

SECRET_VAR = "PHALANX_BENCH_CHANNEL_SECRET"
CONNECT_TIMEOUT_S = 120.0
STORE_WAIT_MS = 60_000  # a survivor's wait for the next round and for the new world's barrier
CONNECTORS = 16  # connecting threads per simulation process


# ----------------------------------------------------------------------------------------- simulated ranks

def _say(obj: dict[str, object]) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


class SimStore:
    """A rank's connection to the job's store: the store's protocol as ``StoreClient`` speaks it (one request
    at a time), without torch."""

    def __init__(self, address: str, secret: str, rank: int) -> None:
        host, _, port = address.rpartition(":")
        deadline = time.monotonic() + CONNECT_TIMEOUT_S
        self._sock = handshake.dial(host, int(port), secret, rank, Role.STORE, deadline, "the job's store")
        self._writer = FrameWriter(self._sock)

    def call(self, op: Op, *items: bytes) -> list[bytes]:
        self._writer.send(Kind.EVENT, pack(op, STORE_WAIT_MS, list(items)))
        frame = read_frame(self._sock)
        if frame is None:
            raise RuntimeError("the store closed the connection")
        status, _, reply = unpack(frame[1], request=False)
        if status != Status.OK:
            raise RuntimeError(f"store {op.name} {items!r}: status {status}")
        return reply

    def close(self) -> None:
        self._sock.close()


@dataclass
class SimRank:
    rank: int
    sock: socket.socket  # the channel's socket: the lines a rank has due go in one write
    channel: WorkerChannel
    store: SimStore | None


def _connect(address: str, store_address: str | None, secret: str, rank: int) -> tuple[SimRank, float]:
    """Connect one rank's supervisor (and its store client): the real handshake, then the payload."""
    host, _, port = address.rpartition(":")
    deadline = time.monotonic() + CONNECT_TIMEOUT_S
    sock = handshake.dial(host, int(port), secret, rank, Role.SUPERVISOR, deadline, "the driver's channel")
    payload = read_frame(sock, deadline=deadline)
    if payload is None or payload[0] is not Kind.PAYLOAD:
        raise RuntimeError(f"rank {rank}: no payload")
    sock.settimeout(None)
    channel = WorkerChannel(sock, payload[1])
    connected = time.monotonic()
    store = SimStore(store_address, secret, rank) if store_address else None
    channel.send(Kind.HELLO, Hello(rank=rank, pid=os.getpid(), host="sim").encode())
    return SimRank(rank, sock, channel, store), connected


def simulate(address: str, store_address: str | None, ranks: range, rate: float, seconds: float) -> None:
    """One simulation process: connect ``ranks``' supervisors, then obey the driver's commands on stdin."""
    secret = os.environ[SECRET_VAR]
    with ThreadPoolExecutor(CONNECTORS) as pool:
        done = list(pool.map(lambda r: _connect(address, store_address, secret, r), ranks))
    sims = {sim.rank: sim for sim, _ in done}
    _say({"connected_at": max(t for _, t in done)})
    sent = dict.fromkeys(sims, 0)
    for command in sys.stdin:
        verb, _, arg = command.strip().partition(" ")
        if verb == "log":
            done_at = _stream(sims, sent, rate, seconds)
            _say({"sent": sent, "done_at": done_at})
        elif verb == "kill":  # these ranks' processes died by SIGKILL: their supervisors report it at once
            for rank in map(int, filter(None, arg.split(","))):
                if rank in sims:
                    lost = sims.pop(rank)
                    lost.channel.send(Kind.EVENT, exit_event(-9))
                    lost.channel.close()
        elif verb == "reform":  # the survivors noticed the loss: the next round, as phalanx.torch.elastic
            _say({"reformed": _reform(sims, int(arg))})
        elif verb in ("stop", "finish"):  # stopped by the driver (SIGTERM), or done (exit 0)
            for sim in sims.values():
                sim.channel.send(Kind.EVENT, exit_event(-15 if verb == "stop" else 0))
                sim.channel.close()
                if sim.store is not None:
                    sim.store.close()
            return


def _reform(sims: dict[int, SimRank], round_no: int) -> dict[str, float]:
    """Every survivor waits for round ``round_no``, reads its assignment and passes the new world's store
    barrier; the latest time one got its assignment and passed the barrier (``time.monotonic()``)."""
    def one(sim: SimRank) -> tuple[float, float]:
        store = sim.store
        assert store is not None
        store.call(Op.WAIT, elastic_keys.round_key(round_no).encode())
        latest = int(store.call(Op.GET, elastic_keys.LATEST_KEY.encode())[0])
        _, size = elastic_keys.decode_assignment(
            store.call(Op.GET, elastic_keys.assign_key(latest, sim.rank).encode())[0])
        assigned = time.monotonic()
        prefix = elastic_keys.group_prefix(latest)
        if int(store.call(Op.ADD, f"{prefix}/arrived".encode(), b"1")[0]) == size:
            store.call(Op.SET, f"{prefix}/all".encode(), b"1")
        store.call(Op.WAIT, f"{prefix}/all".encode())
        return assigned, time.monotonic()

    with ThreadPoolExecutor(max(1, len(sims))) as pool:
        times = list(pool.map(one, sims.values()))
    return {"assigned_at": max(t for t, _ in times), "barrier_at": max(t for _, t in times)}


def _stream(sims: dict[int, SimRank], sent: dict[int, int], rate: float, seconds: float) -> float:
    """Every rank sends ``rate`` numbered lines a second for ``seconds`` (and a heartbeat a second); returns
    when the last line was sent (``time.monotonic()``)."""
    start = time.monotonic()
    beats = 0
    while (now := time.monotonic()) - start < seconds:
        due = int((now - start) * rate) + 1
        for rank, sim in sims.items():
            frames = [encode(Kind.LOG, LogLine(rank, Stream.STDOUT, f"rank {rank} line {seq}").encode())
                      for seq in range(sent[rank], due)]
            if frames:
                sim.sock.sendall(b"".join(frames))
            sent[rank] = max(sent[rank], due)
        if now - start >= beats:
            beats += 1
            for sim in sims.values():
                sim.channel.send(Kind.EVENT, HEARTBEAT)
        time.sleep(max(0.0, start + due / rate - time.monotonic()))
    return time.monotonic()


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
    elastic: int = 0
    formation_s: float = float("nan")
    lines_sent: int = 0
    lines_received: int = 0
    out_of_order: int = 0
    log_seconds: float = 0.0
    lag_s: float = float("nan")
    driver_cpu_cores: float = float("nan")
    driver_peak_rss_mb: float = float("nan")
    driver_threads: int = 0
    verdict_s: float = float("nan")
    root_cause_rank: int | None = None
    killed_rank: int = 0
    lost_ranks: list[int] = field(default_factory=list)
    loss_reported_s: float = float("nan")
    round_published_s: float = float("nan")
    reassigned_s: float = float("nan")
    reformed_s: float = float("nan")
    world_after: int = 0
    job_succeeded: bool = False
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

    def __init__(self, ranks: int, procs: int, rate: float, seconds: float, elastic: int = 0) -> None:
        self.fig = Figures(ranks=ranks, procs=procs, elastic=elastic, killed_rank=ranks // 2)
        self.rate, self.seconds = rate, seconds
        self.channel = DriverChannel(ranks, b"")
        self.store = RendezvousStore(ranks, self.channel.secret) if elastic else None
        self.exits = ExitReports(function_job=False)
        self.exits.attach(self.channel)
        self.sink = CountingSink([0] * ranks)
        self.hellos = 0
        self.formed = threading.Event()
        self.formed_at = 0.0
        self.stopped_at: float | None = None
        self.ended_at: dict[int, float] = {}  # lost rank -> when the monitor judged its end
        self.reformed_at: dict[int, float] = {}  # resets -> when the monitor re-formed the world
        config = MonitorConfig(world_size=ranks, expect_results=False, expect_hello=True,
                               start_timeout_s=CONNECT_TIMEOUT_S, start_timeout_hint="--ranks",
                               stop_wait_s=30.0)
        self.monitor: JobMonitor
        if elastic:
            policy = ElasticPolicy(min_np=ranks - elastic, max_np=ranks)
            self.monitor = ElasticMonitor(config, self.channel.events, [self.sink], stop_all=self._stop_all,
                                          on_custom=self._on_custom, observer=self._observe, policy=policy,
                                          reform=self._reform)
        else:
            self.monitor = JobMonitor(config, self.channel.events, [self.sink], stop_all=self._stop_all,
                                      on_custom=self._on_custom, observer=self._observe)
        self.sims: list[subprocess.Popen[str]] = []

    def _reform(self, alive: list[int], size: int) -> list[int]:
        """The launcher's side of a re-formation (no free slots: the survivors, in order)."""
        assert self.store is not None
        world = alive[:size]
        publish_round(self.store, len(self.reformed_at) + 1, world)
        return world

    def _on_custom(self, event: Custom) -> None:
        if event.body != HEARTBEAT:
            self.exits.on_event(event)

    def _observe(self, event: object) -> None:
        if isinstance(event, RankStarted):
            self.hellos += 1
            if self.hellos == self.fig.ranks:
                self.formed_at = time.monotonic()
                self.formed.set()
        elif isinstance(event, RankEnded) and event.failed:
            self.ended_at[event.rank] = time.monotonic()
        elif isinstance(event, Reformed):
            self.reformed_at[event.resets] = time.monotonic()
            self.fig.world_after = len(event.world)

    def _stop_all(self) -> None:
        if self.stopped_at is None:
            self.stopped_at = time.monotonic()
            self._tell_all("stop")

    def _tell_all(self, command: str) -> None:
        for sim in self.sims:
            self._tell(sim, command)

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
            self.fig.job_succeeded = True
            if not self.fig.elastic:
                self.fig.errors.append("the monitor reported no failure")
        except WorkerFailedError as e:
            self.fig.root_cause_rank = e.failures[0].rank if e.failures else None
            if self.stopped_at is not None and self._killed_at:
                self.fig.verdict_s = self.stopped_at - self._killed_at
            if self.fig.elastic:
                self.fig.errors.append(f"the elastic job failed: {e}"[:500])
        finally:
            for sim in self.sims:
                try:
                    sim.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    sim.kill()
                    sim.wait()
            self.channel.close()
            if self.store is not None:
                self.store.close()
        self.fig.lines_received = sum(self.sink.counts)
        self.fig.out_of_order = self.sink.out_of_order
        return self.fig

    _killed_at = 0.0

    def _script(self) -> None:
        """Start the simulated ranks, wait for formation, stream logs, then kill one rank (or, elastic, lose
        ranks one by one and re-form after each)."""
        try:
            self._start_sims()
            connected = max(float(self._hear(sim)["connected_at"]) for sim in self.sims)
            if not self.formed.wait(CONNECT_TIMEOUT_S):
                raise RuntimeError(f"only {self.hellos} of {self.fig.ranks} hellos in {CONNECT_TIMEOUT_S} s")
            self.fig.formation_s = max(0.0, self.formed_at - connected)
            self.fig.driver_threads = threading.active_count()
            self._log_phase()
            if self.fig.elastic:
                self._lose_and_reform()
                self._tell_all("finish")
            else:
                self._killed_at = time.monotonic()
                self._tell_all(f"kill {self.fig.killed_rank}")
        except Exception as e:  # the monitor's start timeout then ends the run; the error is reported
            self.fig.errors.append(f"{type(e).__name__}: {e}")
            self._stop_all()

    def _log_phase(self) -> None:
        cpu0, wall0 = _cpu_s(), time.monotonic()
        self._tell_all("log")
        sent: dict[str, int] = {}
        done_at = 0.0
        for sim in self.sims:
            heard = self._hear(sim)
            sent.update(heard["sent"])
            done_at = max(done_at, float(heard["done_at"]))
        self.fig.lines_sent = sum(sent.values())
        last = self._await_lines(self.fig.lines_sent)
        self.fig.lag_s = max(0.0, last - done_at)
        self.fig.log_seconds = last - wall0
        self.fig.driver_cpu_cores = (_cpu_s() - cpu0) / self.fig.log_seconds
        self.fig.driver_peak_rss_mb = _peak_rss_mb()

    def _lose_and_reform(self) -> None:
        """Lose ``elastic`` ranks spread over the world, one at a time; after each, every survivor goes
        through the next round. Figures: the worst loss's times from its kill."""
        n, k = self.fig.ranks, self.fig.elastic
        self.fig.lost_ranks = [(i + 1) * n // (k + 1) for i in range(k)]
        times: dict[str, list[float]] = {"reported": [], "published": [], "assigned": [], "reformed": []}
        for round_no, rank in enumerate(self.fig.lost_ranks, start=1):
            killed_at = time.monotonic()
            self._tell_all(f"kill {rank}")
            self._tell_all(f"reform {round_no}")
            heard = [self._hear(sim)["reformed"] for sim in self.sims]
            self._await(lambda r=rank, i=round_no: r in self.ended_at and i in self.reformed_at)
            times["reported"].append(self.ended_at[rank] - killed_at)
            times["published"].append(self.reformed_at[round_no] - killed_at)
            times["assigned"].append(max(float(h["assigned_at"]) for h in heard) - killed_at)
            times["reformed"].append(max(float(h["barrier_at"]) for h in heard) - killed_at)
        self.fig.loss_reported_s = max(times["reported"])
        self.fig.round_published_s = max(times["published"])
        self.fig.reassigned_s = max(times["assigned"])
        self.fig.reformed_s = max(times["reformed"])

    @staticmethod
    def _await(done: Any, timeout_s: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_s
        while not done():
            if time.monotonic() > deadline:
                raise RuntimeError(f"the monitor did not judge the loss within {timeout_s} s")
            time.sleep(0.005)

    def _await_lines(self, total: int, timeout_s: float = 60.0) -> float:
        """Wait until ``total`` lines arrived; when the last did (``time.monotonic()``, to 5 ms)."""
        deadline = time.monotonic() + timeout_s
        while sum(self.sink.counts) < total:
            if time.monotonic() > deadline:
                raise RuntimeError(f"{sum(self.sink.counts)} of {total} lines arrived within {timeout_s} s")
            time.sleep(0.005)
        return time.monotonic()

    def _start_sims(self) -> None:
        n, procs = self.fig.ranks, self.fig.procs
        env = {**os.environ, SECRET_VAR: self.channel.secret}
        store = f"127.0.0.1:{self.store.port}" if self.store is not None else "-"
        for i in range(procs):
            lo, hi = i * n // procs, (i + 1) * n // procs
            argv = [sys.executable, __file__, "--simulate", self.channel.address, store, str(lo), str(hi),
                    str(self.rate), str(self.seconds)]
            self.sims.append(subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                              env=env))


def measure(ranks: int, procs: int, rate: float, seconds: float, elastic: int = 0) -> Figures:
    return Driver(ranks, procs, rate, seconds, elastic).run()


def _table(rows: list[Figures]) -> str:
    head = ("| ranks | formation | lines sent / received | lost | log phase: lines/s (driver lag after the last "
            "line sent) | driver CPU (lines per CPU-second) | driver peak RSS | driver threads | kill to verdict | "
            "root cause |")
    out = [head, "|" + "---|" * 10]
    for f in rows:
        lost = f.lines_sent - f.lines_received + f.out_of_order
        rate = f.lines_received / f.log_seconds if f.log_seconds else float("nan")
        per_cpu = f.lines_received / (f.driver_cpu_cores * f.log_seconds) if f.log_seconds else float("nan")
        verdict = (f"{f.verdict_s * 1e3:.1f} ms | rank {f.root_cause_rank} (killed {f.killed_rank})"
                   if not f.elastic else "(elastic) | -")
        out.append(f"| {f.ranks} | {f.formation_s * 1e3:.1f} ms | {f.lines_sent} / {f.lines_received} | {lost} | "
                   f"{rate:.0f} in {f.log_seconds:.2f} s ({f.lag_s * 1e3:.0f} ms) | {f.driver_cpu_cores:.2f} cores "
                   f"({per_cpu:.0f}) | {f.driver_peak_rss_mb:.0f} MB | {f.driver_threads} | {verdict} |")
    elastic = [f for f in rows if f.elastic]
    if elastic:
        out += ["", "| ranks | lost one at a time | world after | worst loss: reported / round published / "
                "survivors assigned / new world's store barrier passed (from the kill) | job |", "|" + "---|" * 5]
        for f in elastic:
            out.append(f"| {f.ranks} | {f.elastic} (ranks {', '.join(map(str, f.lost_ranks))}) | {f.world_after} | "
                       f"{f.loss_reported_s * 1e3:.0f} / {f.round_published_s * 1e3:.0f} / "
                       f"{f.reassigned_s * 1e3:.0f} / {f.reformed_s * 1e3:.0f} ms | "
                       f"{'succeeded' if f.job_succeeded else 'failed'} |")
    return "\n".join(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", default="128,256,1024", help="comma-separated rank counts")
    parser.add_argument("--procs", type=int, default=4, help="simulation processes")
    parser.add_argument("--rate", type=float, default=100.0, help="log lines per second per rank")
    parser.add_argument("--seconds", type=float, default=3.0, help="seconds of logging")
    parser.add_argument("--elastic", type=int, default=0, metavar="K",
                        help="an elastic job: lose K ranks one at a time, re-forming after each (instead of the "
                             "kill that fails the job)")
    parser.add_argument("--json", action="store_true", help="print one JSON object per run, no table")
    parser.add_argument("--simulate", nargs=6, metavar=("ADDRESS", "STORE", "LO", "HI", "RATE", "SECONDS"),
                        help=argparse.SUPPRESS)
    args = parser.parse_args()
    faulthandler.register(10)  # SIGUSR1: every thread's stack, to see where a large run spends its time
    if args.simulate:
        address, store, lo, hi, rate, seconds = args.simulate
        simulate(address, None if store == "-" else store, range(int(lo), int(hi)), float(rate), float(seconds))
        return
    load = os.getloadavg()
    rows = []
    for n in (int(x) for x in args.ranks.split(",")):
        # each size in a fresh driver process: a process's peak RSS only grows
        if len(args.ranks.split(",")) > 1:
            argv = [sys.executable, __file__, "--ranks", str(n), "--procs", str(args.procs), "--rate",
                    str(args.rate), "--seconds", str(args.seconds), "--elastic", str(args.elastic), "--json"]
            row = Figures(**json.loads(subprocess.run(argv, check=True, capture_output=True, text=True).stdout))
        else:
            row = measure(n, args.procs, args.rate, args.seconds, args.elastic)
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
