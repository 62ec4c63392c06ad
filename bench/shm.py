"""Shared-memory transport vs gloo, 2 ranks on one host, side by side in one job, printed as ratios.

Run: ``.venv/bin/python bench/shm.py [--rounds 9] [--skip-train]``.

* allreduce fp32, 4 KB .. 64 MB: raw ``dist.all_reduce`` on gloo, ``hvd.allreduce_`` (shared memory, the
  whole phalanx.torch path: signature check, control block, payload) and the bare transport
  (``phalanx.transport.all_reduce`` on the payload group), interleaved round by round; medians.
* training (bench/train.py's CNN and MLP): DistributedOptimizer with shared memory vs DDP on gloo, steps/s
  per rank, and the scaling efficiency = 2-rank steps/s over one process alone (plain optimizer). Every
  baseline is a trainer interleaved in the same job (so the host's drift hits all alike): rank 0 alone on all
  cores (the literal definition: each of two ranks on a 2-core host gets one core, so it cannot exceed ~0.5
  there) and on one thread, both ranks training without communicating (``pair``: what the shared host allows
  at best) and the ``floor`` (the ranks meet once per step and do an allreduce's memory traffic without
  communicating). A second 2-rank job with ``PHALANX_SHM=0`` gives DistributedOptimizer on gloo for
  reference; a third runs DDP and FSDP2 on the gloo default group and on a ``phalanx_shm`` group,
  interleaved (the A/B of the launchers' automatic backend substitution).
* ranks on distinct hosts (``HOROVOD_HOSTNAME`` faked per rank): ``hvd.allreduce_``, ``hvd.allgather`` and
  ``hvd.broadcast_`` with the transport on
  (hierarchical: shm in host, gloo across) vs ``PHALANX_SHM=0``, hosts AB (2 ranks) and AABB (4 ranks); then
  torch-native code on AABB: ``dist.all_reduce``, ``dist.reduce_scatter_tensor``, DDP and FSDP2 (CNN, MLP)
  on the gloo default group vs a ``phalanx_shm`` group (hierarchical), interleaved in one job
  (``--hosts-ddp-only`` runs just that).
"""

from __future__ import annotations

import argparse
import functools
import math
import os
import statistics
import sys
import time
from typing import Any

import phalanx

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import train  # bench/train.py: the models and the interleaved trainer

SIZES = [4 << 10, 64 << 10, 1 << 20, 16 << 20, 64 << 20]


def _time(fn: Any, calls: int) -> float:
    import torch.distributed as dist

    dist.barrier()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls


def _allreduce(rounds: int) -> list[dict[str, float]]:
    import torch
    import torch.distributed as dist

    import phalanx.torch as hvd
    from phalanx.torch.process_sets import global_process_set, groups_of
    from phalanx.transport import api as shm

    hvd.init()
    data = groups_of(global_process_set).data
    rows = []
    for nbytes in SIZES:
        x = torch.ones(nbytes // 4)
        calls = max(3, min(200, (8 << 20) // nbytes))
        paths = {"gloo": lambda x=x: dist.all_reduce(x), "hvd": lambda x=x: hvd.allreduce_(x, op=hvd.Sum),
                 "shm": lambda x=x: shm.all_reduce(x, group=data)}
        times: dict[str, list[float]] = {k: [] for k in paths}
        keys = list(paths)
        for r in range(rounds + 1):  # the first round warms up
            # the order rotates: whatever runs right after gloo's allreduce (the cores partly idle in its TCP
            # waits) measured ~3 ms slower at 64 MB, so a fixed order charged it to the same column every time
            for key in keys[r % len(keys) :] + keys[: r % len(keys)]:
                times[key].append(_time(paths[key], calls))
        rows.append({"bytes": nbytes, **{k: statistics.median(v[1:]) for k, v in times.items()}})
    hvd.shutdown()
    return rows


HOST_SIZES = [4 << 10, 1 << 20, 16 << 20]


def _check_cost(rounds: int) -> dict[str, float]:
    """Per-call time of a phalanx_shm allreduce (4 KB, 4 MB) with the signature check that every rank issued the
    same call (issue 24), and with the check skipped, interleaved round by round: medians in us."""
    import statistics

    import torch
    import torch.distributed as dist

    from phalanx.transport import _check

    dist.init_process_group("gloo")  # a one-host job: phalanx_shm stands in
    real = _check.check
    out: dict[str, list[float]] = {}
    for size in (4 << 10, 4 << 20):
        t = torch.ones(size // 4)
        calls = 200 if size < (1 << 20) else 20
        for _ in range(rounds):
            for label, check in (("checked", real), ("unchecked", lambda *a: None)):
                _check.check = check  # type: ignore[assignment]
                out.setdefault(f"{size}/{label}", []).append(_time(functools.partial(dist.all_reduce, t), calls) * 1e6)
    _check.check = real
    dist.destroy_process_group()
    return {k: statistics.median(v) for k, v in out.items()}


def _print_check_cost(r: dict[str, float]) -> None:
    for size in (4 << 10, 4 << 20):
        on, off = r[f"{size}/checked"], r[f"{size}/unchecked"]
        print(f"phalanx_shm allreduce {size >> 10:>5} KB: {on:8.1f} us checked, {off:8.1f} us unchecked: the "
              f"signature check costs {on - off:6.1f} us per call ({on / off:.2f}x)")


def _hosts_allreduce(hosts: list[str], rounds: int) -> dict[str, Any]:
    """fp32 allreduce medians with ``HOROVOD_HOSTNAME`` faked per rank (ranks on distinct hosts): the
    payload group through the transport (hierarchical) and through plain gloo, interleaved, and
    ``hvd.allreduce_``."""
    import torch
    import torch.distributed as dist

    import phalanx.torch as hvd
    from phalanx.torch.process_sets import global_process_set, groups_of
    from phalanx.transport import _dispatch
    from phalanx.transport import api as shm

    os.environ["HOROVOD_HOSTNAME"] = hosts[int(os.environ["RANK"])]
    hvd.init()
    data = groups_of(global_process_set).data
    out: dict[str, Any] = {"routed": id(data) in _dispatch._ROUTES}
    for nbytes in HOST_SIZES:
        x = torch.ones(nbytes // 4)
        calls = max(3, min(100, (4 << 20) // nbytes))
        paths = {"gloo": lambda x=x: dist.all_reduce(x, group=data), "shm": lambda x=x: shm.all_reduce(x, group=data),
                 "hvd": lambda x=x: hvd.allreduce_(x, op=hvd.Sum), "allgather": lambda x=x: hvd.allgather(x),
                 "broadcast_": lambda x=x: hvd.broadcast_(x, root_rank=len(hosts) - 1)}
        times: dict[str, list[float]] = {k: [] for k in paths}
        for _ in range(rounds + 1):
            for key, fn in paths.items():
                times[key].append(_time(fn, calls))
        out[nbytes] = {k: statistics.median(v[1:]) for k, v in times.items()}
    hvd.shutdown()
    return out


def _host_jobs(hosts: list[str], rounds: int, runs: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """``runs`` jobs with the transport on, alternating with ``runs`` with ``PHALANX_SHM=0``; per size and
    path, the median over the jobs (two 4-rank jobs on 2 cores differ by tens of percent from noise alone)."""
    jobs: dict[str, list[dict[str, Any]]] = {"on": [], "off": []}
    for _ in range(runs):
        jobs["on"].append(phalanx.run(_hosts_allreduce, args=(hosts, rounds), np=len(hosts))[0])
        jobs["off"].append(phalanx.run(_hosts_allreduce, args=(hosts, rounds), np=len(hosts),
                                       env={"PHALANX_SHM": "0"})[0])
    merged = []
    for results in jobs.values():
        out: dict[str, Any] = {"routed": results[0]["routed"]}
        for n in HOST_SIZES:
            out[n] = {k: statistics.median(r[n][k] for r in results) for k in results[0][n]}
        merged.append(out)
    return merged[0], merged[1]


def _print_hosts(rounds: int, runs: int) -> None:
    print("ranks on distinct (simulated) hosts, fp32 medians: allreduce on the payload group through the transport "
          f"(hierarchical) vs plain gloo, interleaved in one job; hvd with shm on vs PHALANX_SHM=0 ({runs} jobs "
          "each, alternating; off / on > 1: the transport is faster)")
    for hosts in (["A", "B"], AABB):
        on, off = _host_jobs(hosts, rounds, runs)
        print(f"  hosts {''.join(hosts)}: transport {'used' if on['routed'] else 'not used (one rank per host)'}")
        for n in HOST_SIZES:
            size = f"{n >> 20} MB" if n >= 1 << 20 else f"{n >> 10} KB"
            r, o = on[n], off[n]
            hvd = " | ".join(f"{k} on {r[k] * 1e3:.3f} ms, off {o[k] * 1e3:.3f} ms ({o[k] / r[k]:.2f}x)"
                             for k in ("hvd", "allgather", "broadcast_"))
            print(f"    {size:>6}: gloo {r['gloo'] * 1e3:.3f} ms, transport {r['shm'] * 1e3:.3f} ms "
                  f"(gloo / transport {r['gloo'] / r['shm']:.2f}x) | hvd.allreduce_ / allgather / broadcast_: {hvd}")


def _print_allreduce(rows: list[dict[str, float]]) -> None:
    print("allreduce fp32, 2 ranks, one host; median time per call; ratio = gloo time / shm time")
    print(f"{'size':>7} {'gloo':>10} {'hvd (shm)':>11} {'transport':>10} {'hvd ratio':>10} {'transport ratio':>16}")
    for r in rows:
        n = int(r["bytes"])
        size = f"{n >> 20} MB" if n >= 1 << 20 else f"{n >> 10} KB"
        print(f"{size:>7} {r['gloo'] * 1e3:>8.3f}ms {r['hvd'] * 1e3:>9.3f}ms {r['shm'] * 1e3:>8.3f}ms "
              f"{r['gloo'] / r['hvd']:>9.2f}x {r['gloo'] / r['shm']:>15.2f}x")


class _Floor:
    """A plain optimizer whose ``step()`` first does what a 2-rank allreduce of the gradients cannot avoid, but
    without communicating: one empty step on the grad channel (the ranks meet once per step) and the memory
    traffic of the reduction, with a private copy standing in for the peer's gradients (half of each gradient
    averaged with it: read both, write one; the other half copied from it: read one, write one)."""

    def __init__(self, model: Any, grad: Any) -> None:
        import torch

        self.params = [p for p in model.parameters() if p.requires_grad]
        # the peer's gradients, never shared: zeros, not random numbers (averaging with N(0, 1) "gradients"
        # drove the model's weights to NaN within a few dozen steps, and NaN made the CNN ~16% faster)
        self.peer = [torch.zeros(p.numel()) for p in self.params]
        self.inner, self.grad = torch.optim.SGD(self.params, lr=0.01), grad

    def zero_grad(self) -> None:
        self.inner.zero_grad()

    def step(self) -> None:
        self.grad.barrier().wait()
        for p, peer in zip(self.params, self.peer):
            g, half = p.grad.view(-1), p.numel() // 2
            g[:half].lerp_(peer[:half], 0.5)
            g[half:].copy_(peer[half:])
        self.inner.step()


class _Alone:
    """The one-process baseline, interleaved with the 2-rank trainers: rank 0 trains a plain optimizer with
    ``threads`` intra-op threads while the other ranks wait at a barrier (blocked, their cores idle). Measured in
    the same job as the trainers it is compared with, so that the host's drift (the same 1-process job ran at
    38 and 50 steps/s minutes apart) hits both alike. Other ranks report NaN seconds."""

    def __init__(self, model: Any, threads: int) -> None:
        import torch

        self.model, self.threads = model, threads
        self.opt = torch.optim.SGD(model.parameters(), lr=0.01)

    def __call__(self, shape: tuple[int, ...], steps: int) -> float:
        import torch
        import torch.distributed as dist

        seconds = math.nan
        if dist.get_rank() == 0:
            before = torch.get_num_threads()
            torch.set_num_threads(self.threads)
            try:
                seconds = train._seconds(self.model, self.opt, shape, steps, start_together=False)
            finally:
                torch.set_num_threads(before)
        dist.barrier()
        return seconds


def _bench_2_floor(steps: int, rounds: int) -> dict[str, dict[str, float]]:
    """``train._bench_2`` (DDP on gloo and DistributedOptimizer, interleaved) with more trainers interleaved:
    ``floor``, the ranks meeting once per step and doing an allreduce's memory traffic without communicating
    (:class:`_Floor`): what any allreduce schedule can reach on this host; ``pair``, both ranks training a
    plain optimizer without communicating (what two processes sharing the host reach); ``alone`` and
    ``alone all cores``, rank 0 training alone on one thread and on every core (:class:`_Alone`)."""
    import torch

    import phalanx.torch as hvd
    from phalanx.torch import process_sets

    hvd.init()
    grad = process_sets.groups_of(hvd.global_process_set).grad
    out: dict[str, dict[str, float]] = {}
    for name, (make, shape) in train.MODELS.items():
        trainers = train._trainers(name)
        model, pair = make(), make()
        trainers["floor"] = (model, _Floor(model, grad))
        trainers["pair"] = (pair, torch.optim.SGD(pair.parameters(), lr=0.01))
        trainers["alone"] = _Alone(make(), 1)
        trainers["alone all cores"] = _Alone(make(), os.cpu_count() or 1)
        out[name] = train._interleaved(trainers, shape, steps, rounds)
    hvd.shutdown()
    return out


def _train(steps: int, rounds: int, shm_env: dict[str, str]) -> dict[str, dict[str, float]]:
    job = train._bench_2 if shm_env else _bench_2_floor
    two = phalanx.run(job, args=(steps, rounds), np=2, env=shm_env)[0]
    return two


def _fsdp(make: Any, group: Any) -> Any:
    """``make()`` sharded with FSDP2 over ``group`` (one unit per layer with parameters, and the root)."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    mesh, model = DeviceMesh.from_group(group, "cpu"), make()
    for layer in model:
        if any(True for _ in layer.parameters()):
            fully_shard(layer, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def _ddp_ab(steps: int, rounds: int, hosts: list[str] | None = None) -> dict[str, Any]:
    """DDP and FSDP2, each on the gloo default group and on a ``phalanx_shm`` group, same job, alternating
    chunks of steps (bench/train.py's interleaving): the A/B of what the launchers' automatic substitution
    changes. Keys per model: ``gloo`` / ``shm`` (DDP), ``fsdp gloo`` / ``fsdp shm``. With ``hosts``
    (``HOROVOD_HOSTNAME`` faked per rank: the ``phalanx_shm`` group is hierarchical), also the groups' fp32
    ``dist.all_reduce`` medians under ``"allreduce"`` first."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from phalanx.transport import backend

    if hosts is not None:
        os.environ["HOROVOD_HOSTNAME"] = hosts[int(os.environ["RANK"])]
    dist.init_process_group("gloo")  # the job runs with PHALANX_SHM_NATIVE=0: this stays gloo
    groups = {"gloo": dist.group.WORLD, "shm": dist.new_group(backend=backend.NAME)}
    out: dict[str, Any] = {}
    if hosts is not None:
        out["allreduce"] = _groups_allreduce(groups, rounds)
        out["reduce_scatter"] = _groups_allreduce(groups, rounds, scatter=True)
    for name, (make, shape) in train.MODELS.items():
        trainers = {}
        for key, group in groups.items():
            ddp = DDP(make(), process_group=group)
            trainers[key] = (ddp, torch.optim.SGD(ddp.parameters(), lr=0.01))
            fsdp = _fsdp(make, group)
            trainers[f"fsdp {key}"] = (fsdp, torch.optim.SGD(fsdp.parameters(), lr=0.01))
        out[name] = train._interleaved(trainers, shape, steps, rounds)
    dist.destroy_process_group()
    return out


def _groups_allreduce(groups: dict[str, Any], rounds: int, scatter: bool = False) -> dict[int, dict[str, float]]:
    """fp32 ``dist.all_reduce`` (``scatter``: ``dist.reduce_scatter_tensor`` of an input that size) median per
    call on each group, interleaved round by round."""
    import torch
    import torch.distributed as dist

    out = {}
    for nbytes in HOST_SIZES:
        x = torch.ones(nbytes // 4)
        part = torch.empty(x.numel() // dist.get_world_size())
        calls = max(3, min(100, (4 << 20) // nbytes))
        times: dict[str, list[float]] = {k: [] for k in groups}
        for _ in range(rounds + 1):
            for key, group in groups.items():
                if scatter:
                    fn = lambda x=x, p=part, group=group: dist.reduce_scatter_tensor(p, x, group=group)  # noqa: E731
                else:
                    fn = lambda x=x, group=group: dist.all_reduce(x, group=group)  # noqa: E731
                times[key].append(_time(fn, calls))
        out[nbytes] = {k: statistics.median(v[1:]) for k, v in times.items()}
    return out


AABB = ["A", "A", "B", "B"]


def _print_hosts_ddp(r: dict[str, Any]) -> None:
    print("torch-native code on hosts AABB (4 ranks, simulated): the gloo default group vs a phalanx_shm group "
          "(hierarchical: shm in host, gloo between the hosts' first ranks), interleaved in one job")
    for key, call in (("allreduce", "all_reduce"), ("reduce_scatter", "reduce_scatter_tensor")):
        for n, t in r[key].items():
            size = f"{n >> 20} MB" if n >= 1 << 20 else f"{n >> 10} KB"
            print(f"  dist.{call} fp32 {size:>6}: gloo {t['gloo'] * 1e3:.3f} ms, phalanx_shm {t['shm'] * 1e3:.3f} "
                  f"ms (gloo / phalanx_shm {t['gloo'] / t['shm']:.2f}x)")
    for name in train.MODELS:
        m = r[name]
        print(f"  {name}: DDP gloo {m['gloo']:.2f}/s  DDP phalanx_shm {m['shm']:.2f}/s  ratio "
              f"{m['shm'] / m['gloo']:.2f}x | FSDP2 gloo {m['fsdp gloo']:.2f}/s  FSDP2 phalanx_shm "
              f"{m['fsdp shm']:.2f}/s  ratio {m['fsdp shm'] / m['fsdp gloo']:.2f}x (steps/s per rank)")


_GLOO_DEFAULT = {"PHALANX_SHM_NATIVE": "0"}  # the A/B job's default group stays gloo


def _hosts_ddp(steps: int, rounds: int) -> dict[str, Any]:
    return phalanx.run(_ddp_ab, args=(steps, rounds, AABB), np=len(AABB), env=_GLOO_DEFAULT)[0]


def _print_ddp_ab(ddp_ab: dict[str, Any]) -> None:
    print("DDP and FSDP2, 2 ranks, on the gloo default group vs on a phalanx_shm group, interleaved in one job, "
          "steps/s per rank")
    for name, r in ddp_ab.items():
        print(f"  {name}: DDP gloo {r['gloo']:.2f}/s  DDP phalanx_shm {r['shm']:.2f}/s  "
              f"ratio {r['shm'] / r['gloo']:.2f}x | FSDP2 gloo {r['fsdp gloo']:.2f}/s  "
              f"FSDP2 phalanx_shm {r['fsdp shm']:.2f}/s  ratio {r['fsdp shm'] / r['fsdp gloo']:.2f}x")


def _print_train(shm: dict[str, Any], gloo: dict[str, Any], ddp_ab: dict[str, Any]) -> None:
    print(
        "training, 2 ranks, steps/s per rank (rank 0); every baseline interleaved in the training job: alone = rank"
        " 0 training alone (plain optimizer) while the other rank waits, on 1 thread (alone) and on all"
        f" {os.cpu_count()} cores; pair = both ranks training at once without communicating; floor = the ranks"
        " meeting once per step and doing an allreduce's memory traffic without communicating (what any allreduce"
        " schedule reaches here)"
    )
    print(
        "  efficiency: eff = steps/s per rank / alone on all cores (the literal definition: with one core per"
        f" rank its ceiling is ~{1 / (os.cpu_count() or 1):.2f} here); eff1t = over alone on 1 thread; effpair ="
        " over pair (the host's ceiling)"
    )
    for name, r in shm.items():
        base = {"eff": r["alone all cores"], "eff1t": r["alone"], "effpair": r["pair"]}
        rows = {"hvd shm": r["hvd"], "floor": r["floor"], "DDP gloo": r["ddp"], "pair": r["pair"]}
        cells = " | ".join(f"{k} {v:.2f}/s (" + ", ".join(f"{e} {v / b:.2f}" for e, b in base.items()) + ")"
                           for k, v in rows.items())
        print(f"  {name}: alone {r['alone']:.2f}/s, alone all cores {r['alone all cores']:.2f}/s | {cells}"
              f" | hvd shm / floor {r['hvd'] / r['floor']:.2f}x | hvd shm / DDP gloo {r['hvd'] / r['ddp']:.2f}x"
              f" (per-round interquartile range {r['hvd/ddp q1']:.2f}-{r['hvd/ddp q3']:.2f})"
              f" | other jobs: hvd gloo {gloo[name]['hvd']:.2f}/s ({gloo[name]['hvd'] / gloo[name]['ddp']:.2f}x"
              f" DDP gloo in its job); DDP phalanx_shm / DDP gloo {ddp_ab[name]['shm'] / ddp_ab[name]['gloo']:.2f}x"
              f" ({ddp_ab[name]['shm']:.2f}/s vs {ddp_ab[name]['gloo']:.2f}/s)")


def main() -> None:
    """Run the jobs and print the tables."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--steps", type=int, default=2, help="training steps per interleaved chunk")
    parser.add_argument("--train-rounds", type=int, default=15)
    parser.add_argument("--skip-train", action="store_true")
    parser.add_argument("--skip-hosts", action="store_true", help="skip the simulated multi-host allreduces")
    parser.add_argument("--host-runs", type=int, default=2, help="jobs per setting (on / off) on simulated hosts")
    parser.add_argument("--ddp-only", action="store_true", help="only the DDP / FSDP2 gloo vs phalanx_shm A/B")
    parser.add_argument("--hosts-ddp-only", action="store_true", help="only DDP / FSDP2 gloo vs phalanx_shm on AABB")
    parser.add_argument("--check-only", action="store_true", help="only the cost of phalanx_shm's signature check")
    args = parser.parse_args()
    if args.check_only:
        _print_check_cost(phalanx.run(_check_cost, args=(args.rounds,), np=2)[0])
        print(f"load: {os.getloadavg()[0]:.2f} (1-min average) after the run")
        return
    if args.hosts_ddp_only:
        _print_hosts_ddp(_hosts_ddp(args.steps, args.train_rounds))
        print(f"load: {os.getloadavg()[0]:.2f} (1-min average) after the run")
        return
    if args.ddp_only:
        _print_ddp_ab(phalanx.run(_ddp_ab, args=(args.steps, args.train_rounds), np=2, env=_GLOO_DEFAULT)[0])
        print(f"load: {os.getloadavg()[0]:.2f} (1-min average) after the run")
        return
    print(f"load: {os.getloadavg()[0]:.2f} (1-min average) on {os.cpu_count()} cores")
    _print_allreduce(phalanx.run(_allreduce, args=(args.rounds,), np=2)[0])
    _print_check_cost(phalanx.run(_check_cost, args=(args.rounds,), np=2)[0])
    if not args.skip_hosts:
        _print_hosts(args.rounds, args.host_runs)
        _print_hosts_ddp(_hosts_ddp(args.steps, args.train_rounds))
    if args.skip_train:
        return
    shm = _train(args.steps, args.train_rounds, {})
    gloo = _train(args.steps, args.train_rounds, {"PHALANX_SHM": "0"})
    ddp_ab = phalanx.run(_ddp_ab, args=(args.steps, args.train_rounds), np=2, env=_GLOO_DEFAULT)[0]
    _print_train(shm, gloo, ddp_ab)
    _print_ddp_ab(ddp_ab)
    print(f"load: {os.getloadavg()[0]:.2f} (1-min average) after the run")


if __name__ == "__main__":
    main()
