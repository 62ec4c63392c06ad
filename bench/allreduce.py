"""Allreduce, fp32, 4 KB to 64 MB on 2 ranks: ``hvd.allreduce`` vs raw ``dist.all_reduce``, side by side.

Run: ``.venv/bin/python bench/allreduce.py [--np 2] [--rounds 5]``. Both are timed in the same job,
interleaved round by round (so machine noise hits both alike); each figure is the median over rounds of
the mean time per call. Ratios: throughput = raw time / hvd time (>= 0.9 is the target from 1 MB up);
latency = hvd time / raw time (<= 1.3 is the target at 4 KB). ``hvd.allreduce`` (a new tensor, Average) is
compared with raw in-place ``dist.all_reduce`` and also with what raw code writes for the same result
(``y = x.clone(); dist.all_reduce(y); y.div_(n)``): a fresh output buffer costs gloo itself more than the copy.

Asynchrony (Horovod's ``allreduce_async_`` of 64 MB): how long the call takes to return (the collective runs
on phalanx's background thread), and whether ``hvd.poll`` stayed False until the data had moved (checked
against the expected sum at the first True).
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import phalanx

SIZES = [4 << 10, 64 << 10, 1 << 20, 8 << 20, 64 << 20]


def _calls(nbytes: int) -> int:
    return max(2, min(40, (4 << 20) // nbytes))


def _time(fn: Any, calls: int) -> float:
    import torch.distributed as dist

    dist.barrier()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls


def _raw_average(x: Any) -> Any:
    """Raw torch.distributed's equivalent of ``hvd.allreduce(x)``: a new tensor holding the average."""
    import torch.distributed as dist

    y = x.clone()
    dist.all_reduce(y)
    return y.div_(dist.get_world_size())


def _bench(rounds: int) -> list[dict[str, float]]:
    import torch
    import torch.distributed as dist

    import phalanx.torch as hvd

    hvd.init()
    rows = []
    for nbytes in SIZES:
        x = torch.ones(nbytes // 4)
        calls = _calls(nbytes)
        for _ in range(3):  # warm-up both paths
            dist.all_reduce(x)
            hvd.allreduce_(x, op=hvd.Sum)
        raw, raw_oop, ours, ours_oop = [], [], [], []
        for _ in range(rounds):
            raw.append(_time(lambda x=x: dist.all_reduce(x), calls))
            raw_oop.append(_time(lambda x=x: _raw_average(x), calls))
            ours.append(_time(lambda x=x: hvd.allreduce_(x, op=hvd.Sum), calls))
            ours_oop.append(_time(lambda x=x: hvd.allreduce(x), calls))
        rows.append({"bytes": nbytes, "raw": statistics.median(raw), "hvd_": statistics.median(ours),
                     "hvd": statistics.median(ours_oop), "raw_oop": statistics.median(raw_oop)})
    rows.append(_async_figures(hvd, rounds))
    hvd.shutdown()
    return rows


def _async_figures(hvd: Any, rounds: int) -> dict[str, float]:
    """Median return time of a 64 MB ``allreduce_async_`` and whether ``poll`` was False until done."""
    import torch

    n = hvd.size()
    returns, honest = [], 1.0
    for i in range(rounds):
        x = torch.full(((64 << 20) // 4,), float(i))
        hvd.barrier()
        start = time.perf_counter()
        handle = hvd.allreduce_async_(x, op=hvd.Sum)
        returns.append(time.perf_counter() - start)
        first = hvd.poll(handle)
        while not hvd.poll(handle):
            time.sleep(0.0005)
        moved = bool(x[-1].item() == i * n and x[0].item() == i * n)  # done means the data has moved
        honest = min(honest, 1.0 if moved and not first else 0.0)
        hvd.synchronize(handle)
    return {"async_return": statistics.median(returns), "poll_honest": honest}


def _fmt_size(nbytes: int) -> str:
    return f"{nbytes >> 20} MB" if nbytes >= 1 << 20 else f"{nbytes >> 10} KB"


def main() -> None:
    """Run the benchmark and print a table of times and ratios."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--np", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args()
    rows = phalanx.run(_bench, args=(args.rounds,), np=args.np)[0]
    asynchrony = rows.pop()
    print(f"allreduce fp32, {args.np} ranks, gloo; median of {args.rounds} rounds (time per call)")
    print(f"{'size':>7} {'raw dist':>10} {'hvd.allreduce_':>15} {'hvd.allreduce':>14} "
          f"{'throughput ratio (in-place / new tensor)':>42} {'raw new tensor':>15} "
          f"{'new tensor ratio':>17}")
    for r in rows:
        print(f"{_fmt_size(int(r['bytes'])):>7} {r['raw'] * 1e3:>8.3f}ms {r['hvd_'] * 1e3:>13.3f}ms "
              f"{r['hvd'] * 1e3:>12.3f}ms {r['raw'] / r['hvd_']:>21.2f}x / {r['raw'] / r['hvd']:.2f}x "
              f"{r['raw_oop'] * 1e3:>14.3f}ms {r['raw_oop'] / r['hvd']:>16.2f}x")
    print(f"allreduce_async_ 64 MB: returns in {asynchrony['async_return'] * 1e3:.3f} ms (median); poll() False "
          f"until the data moved: {'yes' if asynchrony['poll_honest'] else 'NO'}")


if __name__ == "__main__":
    main()
