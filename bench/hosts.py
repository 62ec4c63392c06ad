"""Two simulated hosts x 2 ranks (tests/hosts/simhosts.py: network, UTS and mount namespaces, sshd), side by
side in one run, printed as ratios. Needs root (namespaces); prints why and exits 0 where that is missing.

Run: ``.venv/bin/python bench/hosts.py [--rounds 3] [--calls 10]``.

* launch to first allreduce: ``phalanxrun -np 4 -H hosta:2,hostb:2`` started on hosta (host check over ssh,
  agents, ranks) vs ``torchrun --nnodes 2 --nproc-per-node 2 --rdzv-backend c10d`` started by hand in each
  namespace at the same moment; the same rank script (``hvd.init()``, one allreduce) under both; wall time
  from the start to the last rank's first allreduce; rounds interleaved, medians. Target: <= 1.0x.
  ``--launch-hosts N``: only this, on N hosts x 2 ranks (target at 8 hosts: <= 0.5x).
* allreduce fp32 64 MB across the 4 ranks in one phalanxrun job: ``hvd.allreduce_`` (hierarchical: shared
  memory inside a host, host leaders over gloo) vs ``dist.all_reduce`` on the flat gloo default group,
  interleaved call by call; medians. Target: >= 1.5x.
* its floor on this machine (``--floor``): in the same job, the two halves of the hierarchical path timed
  alone — the in-host step (``hvd.allreduce_`` on each host's pair, both hosts at once: shared memory) and
  the cross-host step (``hvd.allreduce_`` on ranks {0, 2}, one per host, the others idle: gloo). Their sum is
  what a hierarchical allreduce that runs the steps one after the other costs at best when the two "hosts"
  share the machine's cores, so flat gloo / that sum is the best ratio reachable here.
* on a network slower than memory (``--shaped RATE [--layouts 3x2,2x4]``): the hosts' links limited to RATE
  in each direction (``tc tbf``; tests/hosts/simhosts.py:shape_link), the shaping verified by one TCP
  transfer between two hosts, then the 64 MB allreduce (hierarchical vs flat gloo, interleaved) for each
  layout HOSTSxRANKS. Printed beside each: what each algorithm must move through one host's link (a ring
  over N ranks sends 2(N-1)/N of the tensor out of each host it crosses; any allreduce among H hosts at least
  2(H-1)/H of it), and so the best ratio any algorithm without compression can reach at that rate.
  Target: >= 1.5x at 1 Gbit/s.
* the shaping itself (``--link-check RATES``, e.g. ``none,10gbit,1gbit``): one TCP transfer between two hosts
  with the links unshaped and shaped to each rate, interleaved round by round in one cluster; medians. A rate
  whose transfer is no faster than the unshaped one is not simulated: the host's own TCP path is slower.
* DDP and FSDP2 on shaped links (``--shaped RATE --ddp``): in one phalanxrun job per layout, the default
  group stays gloo (``PHALANX_SHM_NATIVE=0``: flat gloo, what torchrun's ranks get) and a ``phalanx_shm``
  group (hierarchical: shared memory in a host, the pipelined cross-host step) is built beside it; DDP and
  FSDP2 of bench/train.py's CNN and MLP train on each, interleaved chunk by chunk (bench/shm.py's A/B);
  steps/s per rank.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from tests.hosts.simhosts import (  # noqa: E402
    Cluster,
    host_names,
    set_link_rate,
    simulated_hosts,
    why_unavailable,
)

ELEMENTS_64MB = (64 << 20) // 4
_CONTRACT = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "HOROVOD_RANK", "PHALANX_CHANNEL")


def rank_first(start: float) -> None:
    """A rank of the launch benchmark: the seconds from ``start`` to its first allreduce's end."""
    import torch

    import phalanx.torch as hvd

    hvd.init()
    hvd.allreduce(torch.ones(16))
    # One write: torchrun's ranks of a host share its stdout, and print's separate write of the newline lets
    # two ranks' lines run together.
    sys.stdout.write(f"FIRST {time.time() - start:.4f}\n")
    sys.stdout.flush()
    hvd.shutdown()


def rank_allreduce(calls: int) -> None:
    """A rank of the 64 MB benchmark: hierarchical ``hvd.allreduce_`` vs flat gloo, interleaved."""
    import torch
    import torch.distributed as dist

    import phalanx.torch as hvd

    hvd.init()
    t = torch.ones(ELEMENTS_64MB)
    hier, flat = [], []
    for i in range(calls + 1):
        for kind in (("hier", "flat") if i % 2 else ("flat", "hier")):
            dist.barrier()
            begin = time.perf_counter()
            if kind == "hier":
                hvd.allreduce_(t, op=hvd.Sum)
            else:
                dist.all_reduce(t)
            (hier if kind == "hier" else flat).append(time.perf_counter() - begin)
            t.fill_(1.0)
    if hvd.rank() == 0:
        print("TIMES " + json.dumps({"hier": hier[1:], "flat": flat[1:]}), flush=True)
    hvd.shutdown()


def rank_floor(calls: int) -> None:
    """A rank of ``--floor``: flat gloo, hierarchical, and the hierarchical path's two steps alone."""
    import torch
    import torch.distributed as dist

    import phalanx.torch as hvd

    pairs, cross = [hvd.ProcessSet([0, 1]), hvd.ProcessSet([2, 3])], hvd.ProcessSet([0, 2])
    hvd.init(process_sets=[*pairs, cross])
    mine = pairs[hvd.rank() // 2]
    t = torch.ones(ELEMENTS_64MB)
    kinds = ("flat", "hier", "local", "cross")
    times: dict[str, list[float]] = {k: [] for k in kinds}
    for i in range(calls + 1):
        for kind in kinds[i % 4:] + kinds[:i % 4]:
            dist.barrier()
            begin = time.perf_counter()
            if kind == "flat":
                dist.all_reduce(t)
            elif kind == "hier":
                hvd.allreduce_(t, op=hvd.Sum)
            elif kind == "local":
                hvd.allreduce_(t, op=hvd.Sum, process_set=mine)
            elif hvd.rank() in (0, 2):
                hvd.allreduce_(t, op=hvd.Sum, process_set=cross)
            times[kind].append(time.perf_counter() - begin)
            t.fill_(1.0)
    if hvd.rank() == 0:
        print("TIMES " + json.dumps({k: v[1:] for k, v in times.items()}), flush=True)
    hvd.shutdown()


def rank_ddp(steps_rounds: str) -> None:
    """A rank of ``--ddp``: DDP and FSDP2 on the gloo default group vs on a ``phalanx_shm`` group."""
    sys.path.insert(0, str(REPO / "bench"))
    import shm  # bench/shm.py: the A/B of the launchers' backend substitution

    steps, rounds = (int(x) for x in steps_rounds.split(","))
    out = shm._ddp_ab(steps, rounds)
    if int(os.environ["RANK"]) == 0:
        print("DDP " + json.dumps(out), flush=True)


def _env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k not in _CONTRACT and not k.startswith(("SLURM_", "TORCHELASTIC"))}


def _firsts(stdout: str, ranks: int) -> float:
    values = [float(v) for v in re.findall(r"FIRST (\d+\.\d+)", stdout)]
    if len(values) != ranks:
        raise RuntimeError(f"expected {ranks} ranks to report, got {len(values)}:\n{stdout[-2000:]}")
    return max(values)


def _phalanx_launch(cluster: Cluster, hosts: int = 2) -> float:
    spec = ",".join(f"{h}:2" for h in host_names(hosts))
    argv = [sys.executable, "-m", "phalanx.cli.main", "-np", str(2 * hosts), "-H", spec, "-i", str(cluster.key),
            sys.executable, __file__, "--rank", "first", str(time.time())]
    done = cluster.run_on("hosta", argv, timeout=300, env=_env())
    if done.returncode != 0:
        raise RuntimeError(f"phalanxrun failed: {done.stderr[-2000:]}")
    return _firsts(done.stdout, 2 * hosts)


def _torchrun_launch(cluster: Cluster, round_no: int, hosts: int = 2) -> float:
    start = str(time.time())
    procs = []
    for host in host_names(hosts):
        argv = [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(hosts), "--nproc-per-node", "2",
                "--rdzv-backend", "c10d", "--rdzv-endpoint", f"{cluster.hosts['hosta'].address}:29400",
                "--rdzv-id", f"bench-{round_no}", __file__, "--rank", "first", start]
        procs.append(subprocess.Popen(cluster.argv_on(host, argv), cwd=cluster.workdir, env=_env(),
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    out = ""
    for p in procs:
        stdout, stderr = p.communicate(timeout=300)
        if p.returncode != 0:
            raise RuntimeError(f"torchrun failed: {stderr[-2000:]}")
        out += stdout
    return _firsts(out, 2 * hosts)


def _job(cluster: Cluster, layout: tuple[int, int], kind: str, arg: str, tag: str,
         flags: tuple[str, ...] = ()) -> Any:
    """Run ``--rank kind arg`` in one phalanxrun job on ``layout`` (HOSTS, RANKS per host); rank 0's JSON
    after ``tag``."""
    hosts, per_host = layout
    spec = ",".join(f"{h}:{per_host}" for h in host_names(hosts))
    argv = [sys.executable, "-m", "phalanx.cli.main", "-np", str(hosts * per_host), "-H", spec,
            "-i", str(cluster.key), *flags, sys.executable, __file__, "--rank", kind, arg]
    done = cluster.run_on("hosta", argv, timeout=1800, env=_env())
    if done.returncode != 0:
        raise RuntimeError(f"phalanxrun failed: {done.stderr[-2000:]}")
    line = next(line for line in done.stdout.splitlines() if tag + " " in line)  # after the rank's prefix
    return json.loads(line.split(tag + " ", 1)[1])


def _allreduce(cluster: Cluster, calls: int, kind: str = "allreduce",
               layout: tuple[int, int] = (2, 2)) -> dict[str, list[float]]:
    times: dict[str, list[float]] = _job(cluster, layout, kind, str(calls), "TIMES")
    return times


def _floor(cluster: Cluster, calls: int) -> None:
    med = {k: statistics.median(v) for k, v in _allreduce(cluster, calls, "floor").items()}
    floor = med["local"] + med["cross"]
    print(f"allreduce 64 MB, 4 ranks on 2 hosts sharing 2 cores: flat gloo {med['flat'] * 1e3:.1f} ms, hierarchical "
          f"{med['hier'] * 1e3:.1f} ms ({med['flat'] / med['hier']:.2f}x); its steps alone: in-host (shm, both hosts "
          f"at once) {med['local'] * 1e3:.1f} ms + cross-host (gloo, 1 rank per host) {med['cross'] * 1e3:.1f} ms = "
          f"floor {floor * 1e3:.1f} ms -> at best {med['flat'] / floor:.2f}x of flat gloo here")


_RECEIVE = """
import socket, sys, time
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("0.0.0.0", 29555))
s.listen()
s.settimeout(60)
c, _ = s.accept()
buf, n, begin = bytearray(1 << 20), 0, time.perf_counter()
while True:
    got = c.recv_into(buf)
    if not got:
        break
    n += got
print(n / (time.perf_counter() - begin) / 1e6)
"""

_SEND = """
import socket, sys, time
deadline = time.monotonic() + 30
while True:
    try:
        s = socket.create_connection((sys.argv[1], 29555), timeout=5)
        break
    except OSError:
        if time.monotonic() > deadline:
            raise
        time.sleep(0.05)
block = b"x" * (1 << 20)
for _ in range(int(sys.argv[2])):
    s.sendall(block)
s.close()
"""


def _link_rate(cluster: Cluster, mbytes: int) -> float:
    """MB/s of one TCP transfer of ``mbytes`` MiB from hostb to hosta (the shaping, checked)."""
    receiver = subprocess.Popen(cluster.argv_on("hosta", [sys.executable, "-c", _RECEIVE]), stdout=subprocess.PIPE,
                                text=True)
    sent = cluster.run_on("hostb", [sys.executable, "-c", _SEND, "hosta", str(mbytes)], timeout=120)
    out, _ = receiver.communicate(timeout=120)
    if sent.returncode != 0 or receiver.returncode != 0:
        raise RuntimeError(f"the link check failed: {sent.stderr[-1000:]}")
    return float(out)


def _ring_share(ranks: int) -> float:
    """The part of the tensor a ring allreduce over ``ranks`` sends out of each member (reduce-scatter and
    allgather: 2(n-1)/n); across hosts the same through each host's link."""
    return 2 * (ranks - 1) / ranks


def _shaped(cluster: Cluster, rate: str, layouts: list[tuple[int, int]], calls: int) -> None:
    mb_s = _link_rate(cluster, 256)
    print(f"link {rate}: one TCP transfer hostb -> hosta {mb_s:.0f} MB/s")
    tensor_mb = ELEMENTS_64MB * 4 / 1e6
    for hosts, per_host in layouts:
        times = _allreduce(cluster, calls, layout=(hosts, per_host))
        h_med, f_med = statistics.median(times["hier"]), statistics.median(times["flat"])
        flat_mb, hier_mb = _ring_share(hosts * per_host) * tensor_mb, _ring_share(hosts) * tensor_mb
        print(f"allreduce 64 MB, {hosts} hosts x {per_host} ranks, links {rate}: hierarchical {h_med * 1e3:.0f} ms, "
              f"flat gloo {f_med * 1e3:.0f} ms -> {f_med / h_med:.2f}x (target >= 1.5x); through each host's link "
              f"a flat ring sends {flat_mb:.0f} MB ({flat_mb / mb_s * 1e3:.0f} ms at {mb_s:.0f} MB/s), any "
              f"allreduce at least {hier_mb:.0f} MB ({hier_mb / mb_s * 1e3:.0f} ms): at best "
              f"{flat_mb / hier_mb:.2f}x; calls hier {[round(x * 1e3) for x in times['hier']]} ms, "
              f"flat {[round(x * 1e3) for x in times['flat']]} ms")


def _link_check(rates: list[str | None], rounds: int, mbytes: int) -> None:
    """One TCP transfer hostb -> hosta with the links at each rate (None: unshaped), interleaved; medians."""
    got: dict[str | None, list[float]] = {r: [] for r in rates}
    with tempfile.TemporaryDirectory() as keys, simulated_hosts(REPO, Path(keys)) as cluster:
        for i in range(rounds):
            for rate in rates if i % 2 == 0 else rates[::-1]:
                for host in cluster.hosts:
                    set_link_rate(host, rate)
                got[rate].append(_link_rate(cluster, mbytes))
    print(f"one TCP transfer of {mbytes} MiB hostb -> hosta, links set per transfer, {rounds} rounds interleaved "
          "(medians; MB/s and Gbit/s):")
    for rate, runs in got.items():
        med = statistics.median(runs)
        print(f"  {rate or 'unshaped'}: {med:.0f} MB/s = {med * 8 / 1e3:.2f} Gbit/s; rounds "
              f"{[round(x) for x in runs]}")


def _ddp(cluster: Cluster, rate: str, layouts: list[tuple[int, int]], steps: int, rounds: int) -> None:
    for hosts, per_host in layouts:
        out = _job(cluster, (hosts, per_host), "ddp", f"{steps},{rounds}", "DDP", ("-x", "PHALANX_SHM_NATIVE=0"))
        for name, m in out.items():
            print(f"{name}, {hosts} hosts x {per_host} ranks, links {rate}, steps/s per rank: DDP flat gloo "
                  f"{m['gloo']:.2f}, DDP phalanx_shm (hierarchical) {m['shm']:.2f} -> {m['shm'] / m['gloo']:.2f}x "
                  f"(per-round IQR {m['shm/gloo q1']:.2f}-{m['shm/gloo q3']:.2f}); FSDP2 flat gloo "
                  f"{m['fsdp gloo']:.2f}, FSDP2 phalanx_shm {m['fsdp shm']:.2f} -> "
                  f"{m['fsdp shm'] / m['fsdp gloo']:.2f}x", flush=True)


def _launch_many(hosts: int, rounds: int) -> None:
    """``phalanxrun -H`` over ``hosts`` simulated hosts x 2 ranks vs torchrun started on each host at the same
    moment, interleaved; medians."""
    ph: list[float] = []
    tr: list[float] = []
    with tempfile.TemporaryDirectory() as keys, simulated_hosts(REPO, Path(keys), host_names(hosts)) as cluster:
        for r in range(rounds):
            for which in (("phalanx", "torchrun") if r % 2 == 0 else ("torchrun", "phalanx")):
                if which == "phalanx":
                    ph.append(_phalanx_launch(cluster, hosts))
                else:
                    tr.append(_torchrun_launch(cluster, r, hosts))
    p_med, t_med = statistics.median(ph), statistics.median(tr)
    print(f"launch to first allreduce, {hosts} hosts x 2 ranks: phalanxrun -H {p_med:.2f} s, torchrun on each "
          f"host {t_med:.2f} s -> {p_med / t_med:.2f}x (target <= 0.5x); rounds phalanx "
          f"{[round(x, 2) for x in ph]}, torchrun {[round(x, 2) for x in tr]}")


def _layouts(text: str) -> list[tuple[int, int]]:
    out = []
    for item in text.split(","):
        hosts, _, per_host = item.partition("x")
        out.append((int(hosts), int(per_host)))
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--calls", type=int, default=10)
    p.add_argument("--floor", action="store_true", help="only the 64 MB allreduce and its floor on this machine")
    p.add_argument("--shaped", metavar="RATE", default=None,
                   help="links limited to RATE (tc units: 1gbit, 10gbit): the allreduce per layout only")
    p.add_argument("--layouts", default="3x2,2x4", help="with --shaped: HOSTSxRANKS,... (default 3x2,2x4)")
    p.add_argument("--launch-hosts", type=int, default=0, metavar="N",
                   help="only the launch to the first allreduce, N hosts x 2 ranks")
    p.add_argument("--link-check", metavar="RATES", default=None,
                   help="only the single-transfer check, links at each of RATES (e.g. none,10gbit,1gbit)")
    p.add_argument("--ddp", action="store_true", help="with --shaped: DDP / FSDP2 on flat gloo vs phalanx_shm")
    p.add_argument("--steps", type=int, default=3, help="with --ddp: training steps per interleaved chunk")
    p.add_argument("--rank", nargs=2, default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.rank is not None:
        _rank(*args.rank)
        return 0
    why = why_unavailable()
    if why:
        print(f"bench/hosts.py: skipped: {why}")
        return 0
    if args.launch_hosts:
        _launch_many(args.launch_hosts, args.rounds)
    elif args.link_check is not None:
        rates = [None if r == "none" else r for r in args.link_check.split(",")]
        _link_check(rates, args.rounds, 256)
    elif args.shaped is not None:
        layouts = _layouts(args.layouts)
        names = host_names(max(2, *(h for h, _ in layouts)))
        with tempfile.TemporaryDirectory() as keys, simulated_hosts(REPO, Path(keys), names, args.shaped) as cluster:
            if args.ddp:
                _ddp(cluster, args.shaped, layouts, args.steps, args.rounds)
            else:
                _shaped(cluster, args.shaped, layouts, args.calls)
    else:
        with tempfile.TemporaryDirectory() as keys, simulated_hosts(REPO, Path(keys)) as cluster:
            if args.floor:
                _floor(cluster, args.calls)
            else:
                _launch_and_allreduce(cluster, args.rounds, args.calls)
    return 0


def _rank(kind: str, value: str) -> None:
    if kind == "first":
        rank_first(float(value))
    elif kind == "floor":
        rank_floor(int(value))
    elif kind == "ddp":
        rank_ddp(value)
    else:
        rank_allreduce(int(value))


def _launch_and_allreduce(cluster: Cluster, rounds: int, calls: int) -> None:
    ph: list[float] = []
    tr: list[float] = []
    for r in range(rounds):
        for which in (("phalanx", "torchrun") if r % 2 == 0 else ("torchrun", "phalanx")):
            if which == "phalanx":
                ph.append(_phalanx_launch(cluster))
            else:
                tr.append(_torchrun_launch(cluster, r))
    p_med, t_med = statistics.median(ph), statistics.median(tr)
    print(f"launch to first allreduce, 2 hosts x 2 ranks: phalanxrun -H {p_med:.2f} s, torchrun --nnodes 2 "
          f"{t_med:.2f} s -> {p_med / t_med:.2f}x of torchrun's time (target <= 1.0x); rounds "
          f"phalanx {[round(x, 2) for x in ph]}, torchrun {[round(x, 2) for x in tr]}")
    times = _allreduce(cluster, calls)
    h_med, f_med = statistics.median(times["hier"]), statistics.median(times["flat"])
    print(f"allreduce 64 MB, 4 ranks on 2 hosts: hierarchical {h_med * 1e3:.1f} ms, flat gloo "
          f"{f_med * 1e3:.1f} ms -> {f_med / h_med:.2f}x faster (target >= 1.5x)")


if __name__ == "__main__":
    sys.exit(main())
