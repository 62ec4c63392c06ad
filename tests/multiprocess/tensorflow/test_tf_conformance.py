"""Horovod's TensorFlow semantics that its own suite relies on, on 2 real ranks in one job (importing TF
costs seconds per rank): elastic states save on sync, collectives in any order inside a graph, unnamed graph
ops matched by their TF op name, and every rank able to go on after an expected collective error."""

from __future__ import annotations

from typing import Any

import pytest

import phalanx

pytest.importorskip("tensorflow")
pytestmark = [pytest.mark.multiprocess]

ENV = {"TF_CPP_MIN_LOG_LEVEL": "2"}


def _elastic_sync_saves(me: int) -> dict[str, Any]:
    import horovod.tensorflow as hvd
    import horovod.tensorflow.keras as hvd_keras
    import keras
    import tensorflow as tf

    out: dict[str, Any] = {}
    var = tf.Variable([float(me + 1)] * 2)
    state = hvd.elastic.TensorFlowState([var], epoch=me)
    state.sync()
    var.assign([9.0, 9.0])
    state.restore()
    out["tf state restore after sync"] = (var.numpy().tolist(), state.epoch)
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1, kernel_initializer=keras.initializers.Constant(
        float(me + 1)))])
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    kstate = hvd_keras.elastic.KerasState(model, batch=0)
    kstate.sync()
    model.layers[0].kernel.assign([[7.0], [7.0]])
    kstate.restore()
    out["keras state restore after sync"] = model.layers[0].kernel.numpy().ravel().tolist()
    return out


def _staggered(tf: Any, value: Any, delay_s: float) -> Any:
    """``value`` once ``delay_s`` has passed when the graph runs: makes a graph's independent collectives
    start in an order of the test's choosing on each rank."""
    import time

    def wait(x: Any) -> Any:
        time.sleep(delay_s)  # under test: the order the collectives start in, which must not matter
        return x

    out = tf.numpy_function(wait, [value], Tout=value.dtype, stateful=True)
    out.set_shape(value.shape)
    return out


def _graph_checks(me: int) -> dict[str, Any]:
    """Independent collectives in one TF1 graph, their inputs ready in the opposite order on the two ranks
    (rank 0 first issues the first ones, rank 1 the last ones): Horovod matches them by name whatever the
    order, and names the unnamed ones from their TF op names, which both ranks' graphs share."""
    import horovod.tensorflow as hvd
    import tensorflow as tf

    out: dict[str, Any] = {}
    graph = tf.Graph()
    with graph.as_default():
        dtypes = [tf.uint8, tf.int32, tf.float64, tf.float32, tf.int64, tf.float16]
        n = len(dtypes)
        delays = [0.05 * (i if me == 0 else n - 1 - i) for i in range(n)]
        ones = [_staggered(tf, tf.ones([3 + i], dtype=d), delays[i]) for i, d in enumerate(dtypes)]
        unnamed = [hvd.allreduce(x, op=hvd.Sum) for x in ones]
        named = [hvd.allgather(_staggered(tf, tf.fill([2], float(me)), delays[i]), name=f"g{i}") for i in range(n)]
        bad = hvd.allreduce(tf.ones([4 + me]), name="shapes differ")
        good = hvd.broadcast(tf.fill([2], float(me)), root_rank=1)
        with tf.compat.v1.Session(graph=graph) as session:
            sums, gathered = session.run([unnamed, named])
            out["graph unnamed sums"] = [s.tolist() for s in sums]
            out["graph named gathers"] = [g.tolist() for g in gathered]
            try:  # the failing collective beside independent ones that complete, in any order on each rank
                session.run([bad, named])
                out["graph error"] = "no error"
            except tf.errors.FailedPreconditionError as e:  # Horovod's type for a mismatch (also phalanx's)
                out["graph error"] = f"{type(e).__name__}: {e}"
            out["graph after error"] = session.run(good).tolist()
    return out


def _tf_function_checks(me: int) -> dict[str, Any]:
    import horovod.tensorflow as hvd
    import tensorflow as tf

    @tf.function
    def step(x: Any) -> Any:
        return [hvd.allreduce(tf.cast(x, d), op=hvd.Sum) for d in (tf.int32, tf.float64, tf.uint8)] + [
            hvd.allgather(x, name=f"f{i}") for i in range(4)]

    results = [step(tf.constant([me + 1] * 2)) for _ in range(2)]
    return {"tf.function": [[t.numpy().tolist() for t in r] for r in results]}


def _eager_errors(me: int) -> dict[str, Any]:
    """Expected errors, then the next collective on every rank: small (inline) and large (shared memory)."""
    import horovod.tensorflow as hvd
    import tensorflow as tf

    from phalanx.errors import CollectiveMismatchError

    out: dict[str, Any] = {}
    for label, bad in (("shape", lambda: hvd.allreduce(tf.ones([5 + me]))),
                       ("big shape", lambda: hvd.allreduce(tf.ones([300_000 + me]))),
                       ("dtype", lambda: hvd.allreduce(tf.ones([300_000], dtype=tf.float32 if me else tf.float64))),
                       ("root", lambda: hvd.broadcast(tf.ones([3]), root_rank=me)),
                       ("gather", lambda: hvd.allgather(tf.ones([2, 3 + me])))):
        try:
            bad()
            out[f"{label} error"] = "no error"
        except tf.errors.FailedPreconditionError as e:  # Horovod's type, and phalanx's RuntimeError
            out[f"{label} error"] = type(e).__name__ if isinstance(e, CollectiveMismatchError) else "other"
        out[f"after {label}"] = float(hvd.allreduce(tf.ones([200_000]), op=hvd.Sum).numpy()[-1])
    return out


def _empty_contributions(me: int) -> dict[str, Any]:
    """A rank that sends nothing: TensorFlow hands an empty tensor over with zero strides (a 1-D one keeps
    them through torch's flat view)."""
    import horovod.tensorflow as hvd
    import tensorflow as tf

    out: dict[str, Any] = {}
    for dtype in (tf.uint16, tf.int32, tf.float64, tf.bfloat16):
        rows = tf.zeros([0], dtype=dtype) if me else tf.ones([2], dtype=dtype)
        splits = tf.constant([0, 0] if me else [1, 1], dtype=tf.int32)
        got, received = hvd.alltoall(rows, splits, name=f"empty.{dtype.name}")
        out[f"alltoall {dtype.name}"] = (got.shape.as_list(), received.numpy().tolist())
        out[f"allgather {dtype.name}"] = hvd.allgather(rows).shape.as_list()
    return out


def _inplace_broadcast_in_a_graph(me: int) -> dict[str, Any]:
    """``broadcast_``'s results in a TF1 graph are the assigned values: running them runs the broadcast."""
    import horovod.tensorflow as hvd
    import tensorflow as tf

    graph = tf.Graph()
    with graph.as_default():
        var = tf.compat.v1.Variable(tf.fill([3], float(me)), use_resource=True)
        ref = tf.compat.v1.Variable(tf.fill([2], float(me + 5)), use_resource=False)
        results = hvd.broadcast_([var, ref], root_rank=1)
        with tf.compat.v1.Session(graph=graph) as session:
            session.run(tf.compat.v1.global_variables_initializer())
            got = session.run(results)
            return {"broadcast_ in a graph": ([r.tolist() for r in got], session.run(var).tolist(),
                                              session.run(ref).tolist())}


def _local_and_global_gradients(me: int) -> dict[str, Any]:
    """A partial tape's gradients split into (variable, gradient) pairs of its local and shared sources."""
    import horovod.tensorflow as hvd
    import keras
    import numpy as np
    import tensorflow as tf

    shared = keras.layers.Dense(2, kernel_initializer=keras.initializers.Constant(me + 1.0))
    local = keras.layers.Dense(1, kernel_initializer=keras.initializers.Constant(me + 1.0))
    model = keras.Sequential([keras.Input((3,)), shared, local])
    x = np.ones((1, 3), dtype="float32")
    with tf.GradientTape(persistent=True) as tape:
        loss = tf.reduce_sum(model(x))
    plain = [g.numpy() for g in tape.gradient(loss, model.trainable_variables)]
    tape = hvd.PartialDistributedGradientTape(tape, local_layers=[local])
    local_pairs, global_pairs = tape.get_local_and_global_gradients(loss, model.trainable_variables)
    index = {id(v): i for i, v in enumerate(model.trainable_variables)}
    return {"local and global": (
        [(index[id(v)], bool(np.allclose(g.numpy(), plain[index[id(v)]] / 2))) for v, g in local_pairs],
        [(index[id(v)], hvd.allgather(tf.reshape(g, [1, -1])).numpy().tolist()) for v, g in global_pairs])}


def _job() -> dict[str, Any]:
    import os

    import horovod.tensorflow as hvd
    import tensorflow as tf

    # Without OMP_NUM_THREADS hvd.init() sizes TensorFlow's pools for ranks sharing a host; it must leave the
    # inter-op pool wide for the graph checks' 12 independent collectives in one Session.run.
    os.environ.pop("OMP_NUM_THREADS", None)
    hvd.init()
    me = hvd.rank()
    pools = {"inter-op pool": (tf.config.threading.get_inter_op_parallelism_threads(),
                               os.environ.get("TF_NUM_INTEROP_THREADS"))}
    out = {**pools, **_graph_checks(me), **_tf_function_checks(me), **_eager_errors(me), **_empty_contributions(me),
           **_inplace_broadcast_in_a_graph(me), **_local_and_global_gradients(me), **_elastic_sync_saves(me)}
    hvd.shutdown()
    return out


@pytest.mark.timeout(240)
def test_tensorflow_conformance_on_two_ranks() -> None:
    r0, r1 = phalanx.run(_job, np=2, env=ENV)
    for r in (r0, r1):
        assert r["inter-op pool"] == (0, "64")  # TensorFlow's setting untouched: the variable phalanx set
        assert r["graph unnamed sums"] == [[2] * (3 + i) for i in range(6)]
        assert r["graph named gathers"] == [[0.0, 0.0, 1.0, 1.0]] * 6
        assert r["graph error"].startswith("TFCollectiveMismatchError") and "shape" in r["graph error"]
        assert r["graph after error"] == [1.0, 1.0]
        assert r["tf.function"] == [[[3, 3], [3.0, 3.0], [3, 3], *[[1, 1, 2, 2]] * 4]] * 2
        for label in ("shape", "big shape", "dtype", "root", "gather"):
            assert r[f"{label} error"] == "TFCollectiveMismatchError" and r[f"after {label}"] == 2.0
        for dtype in ("uint16", "int32", "float64", "bfloat16"):
            assert r[f"alltoall {dtype}"] == ([1], [1, 0])  # one row from rank 0, none from rank 1
            assert r[f"allgather {dtype}"] == [2]
        assert r["broadcast_ in a graph"] == ([[1.0] * 3, [6.0] * 2], [1.0] * 3, [6.0] * 2)
        local_pairs, global_pairs = r["local and global"]
        assert local_pairs == [(2, True), (3, True)]  # the local layer's kernel and bias, divided by the size
        assert [i for i, _ in global_pairs] == [0, 1]
        assert all(rows[0] == rows[1] for _, rows in global_pairs)  # reduced: the same on both ranks
        # Horovod's sync() saves after broadcasting: a restore() keeps rank 0's values on every rank
        assert r["tf state restore after sync"] == ([1.0, 1.0], 0)
        assert r["keras state restore after sync"] == [1.0, 1.0]
