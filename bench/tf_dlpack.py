"""What the DLPack route of ``phalanx.tensorflow`` costs against the numpy route, on CPU, 2 ranks.

Run: ``.venv/bin/python bench/tf_dlpack.py [--rounds 8] [--calls 10]`` (~1-2 min).

GPU tensors take the DLPack route (``PHALANX_TF_DLPACK=auto``): TensorFlow hands torch the tensor's own memory
and NCCL reduces it, where the numpy route copies it to the host and back. No GPU here, so this measures what
the route itself costs, on CPU tensors (``PHALANX_TF_DLPACK=1`` vs ``0``), where both reduce over the same
shared-memory transport: the fused gradient allreduce (``ops.fused_allreduce``, the path of Keras'
``DistributedOptimizer`` and ``DistributedGradientTape``), eagerly and inside ``tf.function``, for the
gradients of Horovod's Keras MNIST CNN (1.2M float32 parameters in 8 tensors) and of ResNet-50 (its trainable
weights' sizes, from ``keras.applications``). In each round the two routes alternate (the order reversed every other
round), ``--calls`` calls each; the figure is the median per-call time of the slower rank over the rounds.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import phalanx

ENV = {"TF_CPP_MIN_LOG_LEVEL": "2"}
#: Gradient sizes (elements) of Horovod's Keras MNIST CNN; ResNet-50's come from ``keras.applications``.
MNIST_CNN = [288, 32, 18432, 64, 1179648, 128, 1280, 10]
MODELS = ("mnist_cnn", "resnet50")


def _sizes(model: str) -> list[int]:
    if model == "mnist_cnn":
        return MNIST_CNN
    import keras
    import numpy as np

    return [int(np.prod(w.shape)) for w in keras.applications.ResNet50(weights=None).trainable_weights]


def _job(model: str, rounds: int, calls: int) -> dict[str, Any]:
    import os

    import tensorflow as tf

    import phalanx.tensorflow as hvd
    from phalanx.tensorflow import ops

    hvd.init()
    sizes = _sizes(model)
    tensors = [tf.random.normal([n]) for n in sizes]

    def fused(ts: list[Any]) -> list[Any]:
        return ops.fused_allreduce(ts, hvd.Average, hvd.Compression.none, f"bench.{model}")

    graph = {route: tf.function(lambda *ts: fused(list(ts))) for route in ("0", "1")}
    times: dict[str, list[float]] = {f"{mode} {route}": [] for mode in ("eager", "graph") for route in ("0", "1")}
    for r in range(rounds + 1):  # round 0 warms up (traces the graphs)
        for route in ("0", "1") if r % 2 else ("1", "0"):
            os.environ["PHALANX_TF_DLPACK"] = route
            for mode in ("eager", "graph"):
                hvd.allreduce(tf.zeros([1]), name="sync")  # both ranks start together
                start = time.perf_counter()
                for _ in range(calls):
                    out = fused(tensors) if mode == "eager" else graph[route](*tensors)
                _ = out[-1].numpy()
                if r:
                    times[f"{mode} {route}"].append((time.perf_counter() - start) / calls)
    return {"times": times, "sizes": (len(sizes), sum(sizes))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--calls", type=int, default=10)
    args = parser.parse_args()
    print("| model | mode | numpy route | DLPack route | DLPack / numpy |")
    print("|---|---|---|---|---|")
    for model in MODELS:
        a, b = phalanx.run(_job, args=(model, args.rounds, args.calls), np=2, env=ENV)
        r0, r1, (count, total) = a["times"], b["times"], a["sizes"]
        for mode in ("eager", "graph"):
            per = {}
            for route in ("0", "1"):
                slower = [max(a, b) for a, b in zip(r0[f"{mode} {route}"], r1[f"{mode} {route}"])]
                per[route] = statistics.median(slower) * 1e3
            print(f"| {model} ({total / 1e6:.2f}M in {count}) | {mode} | {per['0']:.2f} ms | {per['1']:.2f} ms | "
                  f"{per['1'] / per['0']:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
