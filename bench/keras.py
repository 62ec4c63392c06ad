"""Keras per-step overhead of ``phalanx.tensorflow.keras``: 2 ranks vs 1, against one gradient allreduce + 1 ms.

Run: ``.venv/bin/python bench/keras.py [--steps 60] [--rounds 3]``. Models: Horovod's classic Keras MNIST CNN
(1.2M parameters, 28x28x1 inputs) and the digits CNN of the examples (40k parameters, 8x8x1); batch 32 per
rank, Adam, ``model.fit`` with ``steps_per_epoch``. Every process gets one intra-op thread (the share a rank
gets on this 2-core machine), so 1 rank and 2 ranks compute with the same resources.

In each job, a plain model (``compile(optimizer=Adam)``) and a distributed one (``DistributedOptimizer``)
alternate in chunks of ``--steps`` steps, the ranks starting each chunk together (so machine noise hits
both alike, and the plain chunks of the 2 ranks overlap as the distributed ones do); a step's time is the median
gap between consecutive ``on_train_batch_end`` calls (per-``fit`` set-up excluded). The 2-rank job also
times one allreduce of a float32 tensor of the model's size (``phalanx.torch``, the collective the bridge
uses, and raw ``torch.distributed.all_reduce`` on gloo for reference).

Overhead = 2-rank distributed step - 1-rank plain step; target: at most the allreduce + 1 ms. On a 2-core
machine that overhead includes the slowdown of two processes computing at once (2-rank plain - 1-rank
plain), so the bridge's own cost (2-rank distributed - 2-rank plain: the collective, waiting for the slower
rank, the numpy_function copies) is printed too, with its ratio to the same target.
"""

from __future__ import annotations

import argparse
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
    ])  # fmt: skip


def _digits_cnn() -> Any:
    import keras

    return keras.Sequential([
        keras.Input((8, 8, 1)), keras.layers.Conv2D(16, 3, padding="same", activation="relu"),
        keras.layers.Conv2D(32, 3, padding="same", activation="relu"), keras.layers.MaxPooling2D(2),
        keras.layers.Flatten(), keras.layers.Dense(64, activation="relu"), keras.layers.Dense(10),
    ])  # fmt: skip


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


def _compiled(hvd: Any, make: Any, distributed: bool) -> Any:
    import keras

    keras.utils.set_random_seed(0)
    model = make()
    opt = keras.optimizers.Adam(1e-3)
    model.compile(optimizer=hvd.DistributedOptimizer(opt) if distributed else opt,
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), jit_compile=False)  # fmt: skip
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


def _job(model_name: str, steps: int, rounds: int) -> dict[str, Any]:
    import tensorflow as tf

    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(2)
    import numpy as np

    import phalanx.tensorflow.keras as hvd

    hvd.init()
    make, side = MODELS[model_name]
    rng = np.random.default_rng(hvd.rank())
    x = rng.random((32 * 8, side, side, 1), dtype=np.float32)
    y = rng.integers(0, 10, size=len(x))
    data = tf.data.Dataset.from_tensor_slices((x, y)).repeat().batch(32)
    models = {"plain": _compiled(hvd, make, False), "hvd": _compiled(hvd, make, True)}
    gaps: dict[str, list[float]] = {"plain": [], "hvd": []}
    for model in models.values():
        model.fit(data, steps_per_epoch=5, epochs=1, verbose=0)  # trace and warm up
    for _ in range(rounds):
        for name, model in models.items():
            hvd.allreduce(tf.zeros(1), name=f"start {name}")  # both ranks run the same variant at once
            rec = _Gaps()
            model.fit(data, steps_per_epoch=steps, epochs=1, verbose=0, callbacks=[rec.callback])
            gaps[name].extend(rec.gaps)
    result = {name: statistics.median(g) * 1e3 for name, g in gaps.items()}
    result["params"] = int(sum(np.prod(w.shape) for w in models["hvd"].trainable_weights))
    if hvd.size() > 1:
        result["allreduce_ms"], result["raw_allreduce_ms"] = _allreduce_ms(result["params"])
    return result


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=60, help="steps per chunk")
    parser.add_argument("--rounds", type=int, default=3, help="chunks per variant")
    parser.add_argument("--models", default="mnist_cnn,digits_cnn")
    args = parser.parse_args(argv)
    print("model | params | 1 rank plain ms/step | 2 ranks plain | 2 ranks DistributedOptimizer | overhead ms "
          "(2-rank hvd - 1-rank plain) | allreduce ms (phalanx / raw gloo) | target = allreduce + 1 ms | "
          "overhead / target | bridge ms (2-rank hvd - 2-rank plain) | bridge / target")  # fmt: skip
    for name in args.models.split(","):
        one = phalanx.run(_job, args=(name, args.steps, args.rounds), np=1, env=ENV)[0]
        two = phalanx.run(_job, args=(name, args.steps, args.rounds), np=2, env=ENV)
        hvd_ms = max(r["hvd"] for r in two)
        plain2 = max(r["plain"] for r in two)
        overhead = hvd_ms - one["plain"]
        target = two[0]["allreduce_ms"] + 1.0
        print(f"{name} | {one['params']:,} | {one['plain']:.2f} | {plain2:.2f} | {hvd_ms:.2f} | {overhead:.2f} | "
              f"{two[0]['allreduce_ms']:.2f} / {two[0]['raw_allreduce_ms']:.2f} | {target:.2f} | "
              f"{overhead / target:.2f} | {hvd_ms - plain2:.2f} | {(hvd_ms - plain2) / target:.2f}",
              flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
