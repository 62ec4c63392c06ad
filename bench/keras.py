"""Keras per-step overhead of ``phalanx.tensorflow.keras``: 2 ranks vs 1, against one gradient allreduce + 1 ms.

Run: ``.venv/bin/python bench/keras.py [--rounds 8] [--steps N] [--detail]`` (~2.5 min). Models: Horovod's
classic Keras MNIST CNN (1.2M parameters, 28x28x1 inputs) and the digits CNN of the examples (40k
parameters, 8x8x1); batch 32 per rank, Adam, ``model.fit`` with ``steps_per_epoch``. Every process (the
single one and each rank) gets the same TF thread counts: one intra-op thread (the share a rank gets on
this 2-core machine), two inter-op (``--intra-op`` / ``--inter-op`` change them).

In each job, three variants alternate in chunks of ``--steps`` steps (default 40 for the MNIST CNN, 150 for
the digits CNN) over ``--rounds`` rounds (default 8; the order is reversed every other round, so a drift in
machine load hits all variants alike), the ranks starting each chunk together: ``plain``
(``compile(optimizer=Adam)``: each rank trains alone, no communication), ``lockstep`` (plain plus a
1-element allreduce after every batch: the ranks wait for each other every step but exchange no gradients)
and ``hvd`` (``DistributedOptimizer``). A chunk's time is the median gap between consecutive
``on_train_batch_end`` calls (per-``fit`` set-up excluded), of the slower rank. Differences between variants
are taken per round (adjacent chunks) and reported as the median [interquartile range] over the rounds; the
step gaps' p10/p50/p90 show each variant's spread. The 2-rank job also times one allreduce of a float32
tensor of the model's size (``phalanx.torch``, the collective the bridge uses, and raw
``torch.distributed.all_reduce`` on gloo for reference).

Two diagnostics say where the lockstep part comes from: *lockstep explained by the spread* is what waiting
for the slower rank would cost if each lockstep step lasted as long as the slower of two independent draws
from the ranks' free-running (plain) step times (median of the pairwise max - median, per round); *CPU of
other processes* is the machine's busy time (``/proc/stat``) minus both ranks' CPU time during the chunks,
in cores (near 0: the noise is the ranks' own, not other jobs'). ``--detail`` prints each round.

Columns: *distributed overhead* = 2-rank hvd - 2-rank plain: the cost of training distributed, measured
against the same single-process training run with the same threads while the other core is as busy (the
fair baseline on a 2-core machine), split into *lockstep* (2-rank lockstep - 2-rank plain: waiting for the
slower rank every step) and *gradient exchange* (2-rank hvd - 2-rank lockstep: the bridge and the
allreduce). *vs 1 rank alone* = 2-rank hvd - 1-rank plain also includes what two processes computing at
once cost on this machine without any communication (2-rank plain - 1-rank plain: plain Keras, two
processes at once, no phalanx, measured 28 -> 42-44 ms per MNIST CNN step). Target: at most the allreduce + 1 ms.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

# This file is named keras.py: keep its directory off sys.path (which phalanx also ships to the ranks), or
# "import keras" would import this script instead of Keras.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

import phalanx  # noqa: E402

ENV = {"TF_CPP_MIN_LOG_LEVEL": "2"}


def _mnist_cnn() -> Any:
    import keras

    return keras.Sequential([
        keras.Input((28, 28, 1)), keras.layers.Conv2D(32, 3, activation="relu"),
        keras.layers.Conv2D(64, 3, activation="relu"), keras.layers.MaxPooling2D(2), keras.layers.Dropout(0.25),
        keras.layers.Flatten(), keras.layers.Dense(128, activation="relu"), keras.layers.Dropout(0.5),
        keras.layers.Dense(10),
    ])


def _digits_cnn() -> Any:
    import keras

    return keras.Sequential([
        keras.Input((8, 8, 1)), keras.layers.Conv2D(16, 3, padding="same", activation="relu"),
        keras.layers.Conv2D(32, 3, padding="same", activation="relu"), keras.layers.MaxPooling2D(2),
        keras.layers.Flatten(), keras.layers.Dense(64, activation="relu"), keras.layers.Dense(10),
    ])


MODELS = {"mnist_cnn": (_mnist_cnn, 28), "digits_cnn": (_digits_cnn, 8)}


class _Gaps:
    """Records the time between consecutive batch ends of one ``fit`` call."""

    def __init__(self) -> None:
        import keras

        gaps: list[float] = []
        last: list[float] = []

        def begin(logs: Any) -> None:
            last.clear()

        def end(batch: int, logs: Any) -> None:
            now = time.perf_counter()
            if last:
                gaps.append(now - last[0])
            last[:] = [now]

        self.gaps = gaps
        self.callback = keras.callbacks.LambdaCallback(on_train_begin=begin, on_train_batch_end=end)


class _Lockstep:
    """A 1-element allreduce after every batch: the ranks wait for each other, no gradients move."""

    def __init__(self) -> None:
        import keras
        import numpy as np

        import phalanx.torch as torch_hvd
        from phalanx.tensorflow import _bridge

        one = np.zeros(1, dtype=np.float32)
        self.callback = keras.callbacks.LambdaCallback(
            on_train_batch_end=lambda batch, logs=None: _bridge.np_allreduce(one, "lockstep", torch_hvd.Sum, 1.0, 1.0))


VARIANTS = ("plain", "lockstep", "hvd")


def _compiled(hvd: Any, make: Any, distributed: bool) -> Any:
    import keras

    keras.utils.set_random_seed(0)
    model = make()
    opt = keras.optimizers.Adam(1e-3)
    model.compile(optimizer=hvd.DistributedOptimizer(opt) if distributed else opt,
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), jit_compile=False)
    return model


def _allreduce_ms(numel: int, reps: int = 40) -> tuple[float, float]:
    import torch
    import torch.distributed as dist

    import phalanx.torch as ptorch

    t = torch.randn(numel)
    out = []
    for fn in (lambda: ptorch.allreduce(t, name="bench"), lambda: dist.all_reduce(t.clone())):
        for _ in range(5):
            fn()
        samples = []
        for _ in range(reps):
            start = time.perf_counter()
            fn()
            samples.append(time.perf_counter() - start)
        out.append(statistics.median(samples) * 1e3)
    return out[0], out[1]


def _busy_s() -> float:
    """Seconds of CPU the whole machine spent busy (every process; /proc/stat, Linux), NaN elsewhere."""
    try:
        with open("/proc/stat") as f:
            fields = [int(v) for v in f.readline().split()[1:8]]
    except (OSError, ValueError):
        return float("nan")
    return (sum(fields) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")  # minus idle and iowait


def _chunk_medians(models: dict[str, Any], extra: dict[str, list[Any]], data: Any, steps: int, rounds: int,
                   hvd: Any) -> tuple[dict[str, list[float]], dict[str, list[list[float]]], dict[str, Any]]:
    """Run the variants in chunks (order reversed every other round); each chunk's median gap and its gaps (ms)."""
    import tensorflow as tf

    medians: dict[str, list[float]] = {name: [] for name in models}
    cpu: dict[str, list[tuple[float, float, float]]] = {name: [] for name in models}
    gaps: dict[str, list[list[float]]] = {name: [] for name in models}
    for r in range(rounds):
        for name in list(models) if r % 2 == 0 else list(reversed(models)):
            hvd.allreduce(tf.zeros(1), name=f"start {name}")  # both ranks run the same variant at once
            rec = _Gaps()
            before = (_busy_s(), time.process_time(), time.perf_counter())
            models[name].fit(data, steps_per_epoch=steps, epochs=1, verbose=0, callbacks=[rec.callback, *extra[name]])
            after = (_busy_s(), time.process_time(), time.perf_counter())
            cpu[name].append((after[0] - before[0], after[1] - before[1], after[2] - before[2]))
            medians[name].append(statistics.median(rec.gaps) * 1e3)
            gaps[name].append([g * 1e3 for g in rec.gaps])
    return medians, gaps, cpu


def _job(model_name: str, steps: int, rounds: int, threads: tuple[int, int]) -> dict[str, Any]:
    import numpy as np
    import tensorflow as tf

    import phalanx.tensorflow.keras as hvd

    hvd.init()
    intra_op, inter_op = threads  # after init, which sizes TF's pools itself (before TF's first op, as here)
    tf.config.threading.set_intra_op_parallelism_threads(intra_op)
    tf.config.threading.set_inter_op_parallelism_threads(inter_op)
    make, side = MODELS[model_name]
    rng = np.random.default_rng(hvd.rank())
    x = rng.random((32 * 8, side, side, 1), dtype=np.float32)
    y = rng.integers(0, 10, size=len(x))
    data = tf.data.Dataset.from_tensor_slices((x, y)).repeat().batch(32)
    variants = VARIANTS if hvd.size() > 1 else ("plain",)  # one process: only its plain step is reported
    models = {name: _compiled(hvd, make, name == "hvd") for name in variants}
    extra = {name: [_Lockstep().callback] if name == "lockstep" else [] for name in variants}
    for name, model in models.items():
        model.fit(data, steps_per_epoch=5, epochs=1, verbose=0, callbacks=extra[name])  # trace and warm up
    medians, gaps, cpu = _chunk_medians(models, extra, data, steps, rounds, hvd)
    result: dict[str, Any] = {"chunks": medians, "cpu": cpu, "plain_gaps": gaps["plain"],
                              "spread": {name: _quantiles([x for c in g for x in c]) for name, g in gaps.items()}}
    result["params"] = int(sum(np.prod(w.shape) for w in models["plain"].trainable_weights))
    if hvd.size() > 1:
        result["allreduce_ms"], result["raw_allreduce_ms"] = _allreduce_ms(result["params"])
    return result


def _quantiles(values: list[float]) -> tuple[float, float, float]:
    """p10, p50 and p90 (p25, p50, p75 for fewer than 10 values)."""
    cuts = statistics.quantiles(values, n=10 if len(values) >= 10 else 4, method="inclusive")
    return cuts[0], statistics.median(values), cuts[-1]


def _fmt(values: list[float]) -> str:
    """Median and interquartile range of per-round figures: ``m [p25..p75]``."""
    lo, mid, hi = statistics.quantiles(values, n=4, method="inclusive") if len(values) > 1 else values * 3
    return f"{mid:.2f} [{lo:.2f}..{hi:.2f}]"


def _per_round(two: list[dict[str, Any]]) -> dict[str, list[float]]:
    """Per round, each variant's chunk median of the slower rank."""
    return {v: [max(ranks) for ranks in zip(*(r["chunks"][v] for r in two))] for v in VARIANTS}


def _jitter_tax(two: list[dict[str, Any]]) -> list[float]:
    """Per round, what lockstep would cost if each step lasted as long as the slower of two independent draws
    from the ranks' free-running (plain) gaps: median of max(gap rank 0, gap rank 1) over all pairs of the
    round's gaps - the slower rank's median. The part of the lockstep cost that the step times' spread
    explains (machine noise and the ranks' own variance), with no communication at all."""
    import numpy as np

    out = []
    for a, b in zip(two[0]["plain_gaps"], two[1]["plain_gaps"]):
        pair_max = float(np.median(np.maximum.outer(np.asarray(a), np.asarray(b))))
        out.append(pair_max - max(statistics.median(a), statistics.median(b)))
    return out


def _others_cores(two: list[dict[str, Any]]) -> list[float]:
    """Per chunk, the CPU (in cores) that processes other than the two ranks used while the ranks trained:
    the machine's busy time minus both ranks' CPU time, over the chunk's wall time (rank 0's clock)."""
    out = []
    for v in VARIANTS:
        for (busy, own0, wall), (_, own1, _) in zip(two[0]["cpu"][v], two[1]["cpu"][v]):
            out.append((busy - own0 - own1) / wall)
    return out


def _row(name: str, one: dict[str, Any], two: list[dict[str, Any]]) -> str:
    rounds = _per_round(two)
    target = two[0]["allreduce_ms"] + 1.0
    diff = {k: [x - y for x, y in zip(rounds[a], rounds[b])]
            for k, (a, b) in {"overhead": ("hvd", "plain"), "lockstep": ("lockstep", "plain"),
                              "exchange": ("hvd", "lockstep")}.items()}
    ratio = [d / target for d in diff["overhead"]]
    alone = statistics.median(rounds["hvd"]) - statistics.median(one["chunks"]["plain"])
    spread = " ; ".join(f"{v} " + "/".join(f"{q:.1f}" for q in max((r["spread"][v] for r in two), key=lambda t: t[1]))
                        for v in VARIANTS)
    return (f"{name} | {one['params']:,} | {statistics.median(one['chunks']['plain']):.2f} | "
            + " | ".join(f"{statistics.median(rounds[v]):.2f}" for v in VARIANTS)
            + f" | {two[0]['allreduce_ms']:.2f} / {two[0]['raw_allreduce_ms']:.2f} | {target:.2f} | "
            f"{_fmt(diff['overhead'])} | {_fmt(ratio)} | {_fmt(diff['lockstep'])} | {_fmt(_jitter_tax(two))} | "
            f"{_fmt(diff['exchange'])} | "
            f"{alone:.2f} | {alone / target:.2f} | {spread} | {_fmt(_others_cores(two))}")


def _print_rounds(name: str, two: list[dict[str, Any]]) -> None:
    """Each round: the slower rank's chunk medians and the other processes' CPU (cores) during each chunk."""
    rounds = _per_round(two)
    for r in range(len(rounds["plain"])):
        cells = []
        for v in VARIANTS:
            (busy, own0, wall), (_, own1, _) = two[0]["cpu"][v][r], two[1]["cpu"][v][r]
            cells.append(f"{v} {rounds[v][r]:.2f} ms (others {(busy - own0 - own1) / wall:.2f} cores)")
        print(f"  {name} round {r}: " + ", ".join(cells), flush=True)


STEPS = {"mnist_cnn": 40, "digits_cnn": 150}  # per chunk: ~1.5 s (MNIST CNN) / ~0.6 s (digits CNN) of steps


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=0, help=f"steps per chunk (default per model: {STEPS})")
    parser.add_argument("--rounds", type=int, default=8, help="chunks per variant (rounds)")
    parser.add_argument("--intra-op", type=int, default=1, help="TF intra-op threads of every process")
    parser.add_argument("--inter-op", type=int, default=2, help="TF inter-op threads of every process")
    parser.add_argument("--models", default="mnist_cnn,digits_cnn")
    parser.add_argument("--detail", action="store_true", help="also print each round's figures")
    args = parser.parse_args(argv)
    print("model | params | ms/step: 1 rank plain | 2 ranks plain | 2 ranks lockstep | 2 ranks hvd | "
          "allreduce ms (phalanx / raw gloo) | target = allreduce + 1 ms | distributed overhead ms (2-rank hvd - "
          "2-rank plain) | overhead / target | of which lockstep | lockstep explained by the spread of plain "
          "steps (median of max of 2 draws - median) | of which gradient exchange | vs 1 rank alone "
          "ms (2-rank hvd - 1-rank plain) | vs 1 rank / target | step gaps p10/p50/p90 ms (slower rank) | "
          "CPU of other processes during the 2-rank chunks (cores)")
    for name in args.models.split(","):
        job_args = (name, args.steps or STEPS[name], args.rounds, (args.intra_op, args.inter_op))
        one = phalanx.run(_job, args=job_args, np=1, env=ENV)[0]
        two = phalanx.run(_job, args=job_args, np=2, env=ENV)
        print(_row(name, one, two), flush=True)
        if args.detail:
            _print_rounds(name, two)


if __name__ == "__main__":
    main()
