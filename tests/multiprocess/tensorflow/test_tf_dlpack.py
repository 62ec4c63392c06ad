"""The DLPack route of phalanx.tensorflow (TensorFlow tensor -> torch tensor on the same memory -> collective ->
back), which GPU tensors take: forced on CPU here (``PHALANX_TF_DLPACK=1``; DLPack works on CPU tensors too),
on 2 real ranks, eagerly and inside ``tf.function``; its results must equal the numpy route's bit for bit, the
inputs must stay untouched, and the route must really be taken (a counter on its conversion)."""

from __future__ import annotations

from typing import Any

import pytest

import phalanx

pytest.importorskip("tensorflow")
pytestmark = [pytest.mark.multiprocess]


def _ops(hvd: Any, me: int) -> dict[str, Any]:
    import tensorflow as tf

    from phalanx.tensorflow import ops

    x = tf.constant([[1.0, 2.0], [3.0, 4.0]]) * (me + 1)
    mixed = [x, tf.cast(x, tf.bfloat16), tf.cast(x, tf.float16), tf.constant([me + 1, 7], tf.int32),
             tf.constant(float(me), tf.float64), tf.zeros([0, 3]), tf.ones([5]) * (me + 1)]
    out: dict[str, Any] = {
        "sum": hvd.allreduce(x, op=hvd.Sum).numpy().tolist(),
        "avg": hvd.allreduce(x, name="avg").numpy().tolist(),
        "max int": hvd.allreduce(tf.constant([me, 5 - me]), op=hvd.Max).numpy().tolist(),
        "allgather": hvd.allgather(tf.fill([me + 1, 2], me)).numpy().tolist(),
        "broadcast": hvd.broadcast(tf.constant([float(me + 3)]), root_rank=1).numpy().tolist(),
        "fused": [t.numpy().tolist() for t in ops.fused_allreduce(mixed, hvd.Average, hvd.Compression.none, "f")],
        "fused sum": [t.numpy().tolist() for t in ops.fused_allreduce(mixed[:4], hvd.Sum, hvd.Compression.none,
                                                                      "fs", post=0.5)],
        "fused dtypes": [t.dtype.name for t in ops.fused_allreduce(mixed, hvd.Sum, hvd.Compression.none, "fd")],
        "input untouched": x.numpy().tolist() == [[me + 1.0, 2.0 * (me + 1)], [3.0 * (me + 1), 4.0 * (me + 1)]],
    }
    graph = tf.function(lambda t: (hvd.allreduce(t, op=hvd.Sum), hvd.allgather(t), hvd.broadcast(t, 0),
                                   ops.fused_allreduce([t, tf.cast(t, tf.bfloat16)], hvd.Average,
                                                       hvd.Compression.fp16, "g")))
    s, g, b, fused = graph(x)
    out["graph"] = [s.numpy().tolist(), g.numpy().tolist(), b.numpy().tolist(), [f.numpy().tolist() for f in fused],
                    s.shape.as_list()]
    return out


def _training(hvd: Any, me: int) -> list[float]:
    """A few steps of a tiny Keras model with the distributed optimizer: the gradients' fused allreduce."""
    import keras
    import numpy as np

    keras.utils.set_random_seed(3)
    rng = np.random.default_rng(me)
    x = rng.normal(size=(32, 4)).astype("float32")
    y = x.sum(axis=1, keepdims=True)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3), keras.layers.Dense(1)])
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.05)), loss="mse")
    model.fit(x, y, batch_size=8, epochs=1, verbose=0)
    return [float(v) for w in model.get_weights() for v in np.ravel(w)]


def _job() -> dict[str, Any]:
    import os

    import phalanx.tensorflow.keras as hvd

    # white-box: counts the zero-copy bridge's calls, an internal seam (no public name)
    from phalanx.tensorflow import _dlpack

    hvd.init()
    me = hvd.rank()
    calls = [0]
    original = _dlpack.to_torch

    def counted(tensor: Any) -> Any:
        calls[0] += 1
        return original(tensor)

    _dlpack.to_torch = counted  # type: ignore[assignment]
    routes = {}
    for route in ("0", "1"):
        os.environ["PHALANX_TF_DLPACK"] = route
        before = calls[0]
        routes[route] = {**_ops(hvd, me), "weights": _training(hvd, me), "dlpack calls": calls[0] - before}
    return routes


@pytest.mark.timeout(240)
def test_the_dlpack_route_gives_the_numpy_routes_results_eagerly_in_graphs_and_in_keras() -> None:
    r0, r1 = phalanx.run(_job, np=2, env={"TF_CPP_MIN_LOG_LEVEL": "2"})
    for r in (r0, r1):
        assert r["0"]["dlpack calls"] == 0 and r["1"]["dlpack calls"] > 20, (r["0"]["dlpack calls"],
                                                                             r["1"]["dlpack calls"])
        numpy_route, dlpack_route = dict(r["0"]), dict(r["1"])
        del numpy_route["dlpack calls"], dlpack_route["dlpack calls"]
        assert dlpack_route == numpy_route
        assert dlpack_route["input untouched"] is True
    dl = r0["1"]
    assert dl["sum"] == [[3.0, 6.0], [9.0, 12.0]] and dl["avg"] == [[1.5, 3.0], [4.5, 6.0]]
    assert dl["max int"] == [1, 5]
    assert dl["allgather"] == [[0, 0], [1, 1], [1, 1]] and r1["1"]["broadcast"] == [4.0]
    assert dl["fused"] == [[[1.5, 3.0], [4.5, 6.0]]] * 3 + [[1, 7], 0.5, [], [1.5] * 5]
    assert dl["fused sum"] == [[[1.5, 3.0], [4.5, 6.0]]] * 3 + [[1, 7]]
    assert dl["fused dtypes"] == ["float32", "bfloat16", "float16", "int32", "float64", "float32", "float32"]
    assert dl["graph"][0] == [[3.0, 6.0], [9.0, 12.0]] and dl["graph"][4] == [2, 2]
    assert dl["graph"][3] == [[[1.5, 3.0], [4.5, 6.0]]] * 2
    assert r0["1"]["weights"] == r1["1"]["weights"]
