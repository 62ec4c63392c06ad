"""horovod.tensorflow's surface beyond Keras on 2 real ranks: the collectives Horovod has (reducescatter,
alltoall, grouped allgather, in-place broadcast, join, graph ops, objects, sparse allreduce), their gradients,
DistributedGradientTape (also partial and grouped), PartialDistributedOptimizer, the TF-level
DistributedOptimizer, SyncBatchNormalization, and an elastic Keras job that survives a SIGKILLed rank.
Each job packs many checks: importing TF costs seconds per rank."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

import phalanx
from phalanx.env import names as env_names

pytest.importorskip("tensorflow")
pytestmark = [pytest.mark.multiprocess]

ENV = {"TF_CPP_MIN_LOG_LEVEL": "2"}


def _collective_checks(hvd: Any, me: int) -> dict[str, Any]:
    import numpy as np
    import tensorflow as tf

    out: dict[str, Any] = {}
    rows = tf.constant([[1.0], [2.0], [3.0], [4.0]]) * (me + 1)
    out["reducescatter sum"] = hvd.reducescatter(rows, op=hvd.Sum).numpy().ravel().tolist()
    out["reducescatter avg"] = hvd.reducescatter(rows).numpy().ravel().tolist()
    out["grouped reducescatter"] = [t.numpy().ravel().tolist() for t in hvd.grouped_reducescatter([rows, rows * 2],
                                                                                                   op=hvd.Sum)]
    even = hvd.alltoall(tf.range(4) + 10 * me)
    out["alltoall returns a tensor"] = isinstance(even, tf.Tensor)
    out["alltoall"] = even.numpy().tolist()
    got, received = hvd.alltoall(tf.range(4) + 10 * me, splits=[1, 3])
    out["alltoall splits"] = (got.numpy().tolist(), received.numpy().tolist())
    gathered = hvd.grouped_allgather([tf.fill([me + 1], float(me)), tf.constant([[me, me]])])
    out["grouped allgather"] = [g.numpy().tolist() for g in gathered]
    var = tf.Variable([float(me + 5)])
    out["broadcast_"] = [float(v.numpy()[0]) for v in hvd.broadcast_([var], root_rank=1)] + [float(var.numpy()[0])]
    out["graph ops"] = [int(hvd.rank_op()), int(hvd.size_op()), int(hvd.local_size_op()), int(hvd.local_rank_op()),
                        int(hvd.process_set_included_op())]
    out["graph ops in tf.function"] = int(tf.function(lambda: hvd.rank_op() + 10 * hvd.size_op())())
    out["objects"] = (hvd.allgather_object({"rank": me}), hvd.broadcast_object(f"from {me}", root_rank=1),
                      hvd.broadcast_object_fn(root_rank=0)(me + 100))
    out["built"] = (hvd.gloo_built(), hvd.gloo_enabled(), hvd.mpi_built(), hvd.ddl_built(), hvd.ccl_built())
    sparse = tf.IndexedSlices(tf.constant([[float(me + 1)]]), tf.constant([me]), tf.constant([2, 1]))
    for op_name, op in (("sum", hvd.Sum), ("avg", hvd.Average)):
        reduced = hvd.allreduce(sparse, op=op)
        out[f"sparse {op_name}"] = (type(reduced).__name__, reduced.values.numpy().ravel().tolist(),
                                    reduced.indices.numpy().tolist())
    out["scoped name"] = tf.function(lambda: _scoped())().numpy().decode()
    out["join"] = int(hvd.join())
    out["keras value="] = float(np.asarray(_keras().allreduce(value=tf.constant([float(me)]), op=hvd.Sum))[0])
    return out


def _keras() -> Any:
    import phalanx.tensorflow.keras as hvd_keras

    return hvd_keras


def _scoped() -> Any:
    import tensorflow as tf

    from phalanx.tensorflow.ops import scoped_name

    with tf.name_scope("outer"):
        return tf.constant(f"{scoped_name('x', False)}|{scoped_name('x', True)}")


def _gradient_checks(hvd: Any, me: int) -> dict[str, Any]:
    import tensorflow as tf

    out: dict[str, Any] = {}
    x = tf.Variable([1.0, 2.0])
    with tf.GradientTape(persistent=True) as tape:
        summed = tf.reduce_sum(hvd.allreduce(x * (me + 1), op=hvd.Sum, name="g.allreduce"))
        gathered = tf.reduce_sum(hvd.allgather(x * (me + 1), name="g.allgather") * [1.0, 2.0, 3.0, 4.0])
        bcast = tf.reduce_sum(hvd.broadcast(x, root_rank=0, name="g.broadcast") * 3.0)
        scattered = tf.reduce_sum(hvd.reducescatter(x, op=hvd.Sum, name="g.reducescatter"))
    for key, target in (("allreduce", summed), ("allgather", gathered), ("broadcast", bcast),
                        ("reducescatter", scattered)):
        out[f"grad {key}"] = tape.gradient(target, x).numpy().tolist()
    return out


def _tape_training(hvd: Any, me: int) -> dict[str, Any]:
    import keras
    import numpy as np
    import tensorflow as tf
    from _keras_helpers import weights_agree

    out: dict[str, Any] = {}
    rng = np.random.default_rng(me)
    ids, target = rng.integers(0, 20, size=(16, 3)), rng.normal(size=(16, 1)).astype("float32")
    for label, wrap in (("grouped sparse", lambda t: hvd.DistributedGradientTape(t, groups=2)),
                        ("sparse as dense", lambda t: hvd.DistributedGradientTape(t, sparse_as_dense=True))):
        keras.utils.set_random_seed(7)  # the same initial weights on both ranks
        model = keras.Sequential([keras.Input((3,), dtype="int32"), keras.layers.Embedding(20, 4),
                                  keras.layers.Flatten(), keras.layers.Dense(1)])
        opt = keras.optimizers.SGD(0.1)
        for _ in range(3):
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean((model(ids) - target) ** 2)
            grads = wrap(tape).gradient(loss, model.trainable_variables)
            opt.apply_gradients(zip(grads, model.trainable_variables))
        out[f"tape {label} agree"] = weights_agree(hvd, model)
    out.update(_partial_checks(hvd, me))
    return out


def _partial_checks(hvd: Any, me: int) -> dict[str, Any]:
    import keras
    import numpy as np
    import tensorflow as tf
    from _keras_helpers import weights_agree

    out: dict[str, Any] = {}
    x = np.random.default_rng(me).normal(size=(32, 4)).astype("float32")
    y = (x.sum(axis=1, keepdims=True) > 0).astype("float32")
    keras.utils.set_random_seed(3)
    shared, local = keras.layers.Dense(4), keras.layers.Dense(1)
    model = keras.Sequential([keras.Input((4,)), shared, local])
    opt = keras.optimizers.SGD(0.1)
    for _ in range(2):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean((model(x) - y) ** 2)
        tape = hvd.PartialDistributedGradientTape(tape, local_layers=[local])
        opt.apply_gradients(zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables))
    out["partial tape"] = (_same(hvd, shared), _same(hvd, local))
    keras.utils.set_random_seed(3)
    shared, local = keras.layers.Dense(4), keras.layers.Dense(1)
    model = keras.Sequential([keras.Input((4,)), shared, local])
    hk = _keras()
    model.compile(optimizer=hk.PartialDistributedOptimizer(keras.optimizers.SGD(0.1), local_layers=local), loss="mse")
    model.fit(x, y, batch_size=8, epochs=1, verbose=0)
    out["partial optimizer"] = (_same(hvd, shared), _same(hvd, local))
    keras.utils.set_random_seed(3)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.1)), loss="mse")
    model.fit(x, y, batch_size=8, epochs=1, verbose=0)
    out["tf-level optimizer on keras"] = weights_agree(hvd, model)
    out.update(_legacy_and_bn(hvd, me, x))
    return out


def _same(hvd: Any, layer: Any) -> bool:
    import numpy as np

    mine = np.concatenate([np.asarray(w).ravel() for w in layer.get_weights()])
    every = hvd.allgather(mine.reshape(1, -1)).numpy()
    return bool((every == every[0]).all())


def _legacy_and_bn(hvd: Any, me: int, x: Any) -> dict[str, Any]:
    import tensorflow as tf

    out: dict[str, Any] = {}
    w = tf.Variable([[0.5], [0.5], [0.5], [0.5]])
    legacy = hvd.DistributedOptimizer(tf.compat.v1.train.GradientDescentOptimizer(0.1))
    pairs = legacy.compute_gradients(lambda: tf.reduce_mean(tf.matmul(x, w) ** 2), var_list=[w])
    legacy.apply_gradients(pairs)
    out["legacy optimizer agree"] = bool((hvd.allgather(tf.reshape(w, [1, -1])).numpy()[0] ==
                                          hvd.allgather(tf.reshape(w, [1, -1])).numpy()[1]).all())
    try:
        hvd.broadcast_global_variables(0)
        out["eager broadcast_global_variables"] = "no error"
    except RuntimeError as e:
        out["eager broadcast_global_variables"] = str(e)
    bn = hvd.SyncBatchNormalization(momentum=0.0)
    batch = tf.constant(x[: 4 + 4 * me])  # 4 rows on rank 0, 8 on rank 1: the statistics weigh rows, not ranks
    bn(batch, training=True)
    every = hvd.allgather(batch).numpy()
    out["sync bn"] = (bn.moving_mean.numpy().tolist(), every.mean(axis=0).tolist(),
                      bn.moving_variance.numpy().tolist(), every.var(axis=0).tolist())
    return out


def _api_job() -> dict[str, Any]:
    import phalanx.tensorflow as hvd

    hvd.init()
    me = hvd.rank()
    return {**_collective_checks(hvd, me), **_gradient_checks(hvd, me), **_tape_training(hvd, me)}


@pytest.mark.timeout(240)
def test_horovod_tensorflow_collectives_gradients_tapes_and_optimizers() -> None:
    helpers = str(Path(__file__).parent)
    r0, r1 = phalanx.run(_api_job, np=2, env={**ENV, "PYTHONPATH": helpers})
    assert (r0["reducescatter sum"], r1["reducescatter sum"]) == ([3.0, 6.0], [9.0, 12.0])
    assert (r0["reducescatter avg"], r1["reducescatter avg"]) == ([1.5, 3.0], [4.5, 6.0])
    assert r1["grouped reducescatter"] == [[9.0, 12.0], [18.0, 24.0]]
    assert r0["alltoall returns a tensor"] is True
    assert (r0["alltoall"], r1["alltoall"]) == ([0, 1, 10, 11], [2, 3, 12, 13])
    assert r0["alltoall splits"] == ([0, 10], [1, 1]) and r1["alltoall splits"] == ([1, 2, 3, 11, 12, 13], [3, 3])
    assert r0["grouped allgather"] == r1["grouped allgather"] == [[0.0, 1.0, 1.0], [[0, 0], [1, 1]]]
    assert r0["broadcast_"] == r1["broadcast_"] == [6.0, 6.0]
    assert (r0["graph ops"], r1["graph ops"]) == ([0, 2, 2, 0, 1], [1, 2, 2, 1, 1])
    assert (r0["graph ops in tf.function"], r1["graph ops in tf.function"]) == (20, 21)
    assert r0["objects"] == ([{"rank": 0}, {"rank": 1}], "from 1", 100) and r1["objects"][2] == 100
    assert r0["built"] == (True, True, False, False, False)
    assert r0["sparse sum"] == ("IndexedSlices", [1.0, 2.0], [0, 1])
    assert r0["sparse avg"] == ("IndexedSlices", [0.5, 1.0], [0, 1])
    assert r0["scoped name"] == "outer/x|x"
    assert r0["join"] == r1["join"] and r0["join"] in (0, 1)
    assert r0["keras value="] == 1.0
    # Horovod's gradients: allreduce -> allreduce (Sum) of the gradient; allgather -> this rank's slice of the
    # averaged gradient; broadcast -> averaged gradient on the root, zeros elsewhere; reducescatter (Sum) ->
    # allgather of the gradient times the size.
    assert r0["grad allreduce"] == [2.0, 2.0] and r1["grad allreduce"] == [4.0, 4.0]
    assert r0["grad allgather"] == [1.0, 2.0] and r1["grad allgather"] == [6.0, 8.0]
    assert r0["grad broadcast"] == [3.0, 3.0] and r1["grad broadcast"] == [0.0, 0.0]
    assert r0["grad reducescatter"] == r1["grad reducescatter"] == [2.0, 2.0]
    for key in ("tape grouped sparse agree", "tape sparse as dense agree", "tf-level optimizer on keras",
                "legacy optimizer agree"):
        assert r0[key] is True and r1[key] is True, key
    assert r0["partial tape"] == r0["partial optimizer"] == (True, False)
    assert "does not support eager execution" in r0["eager broadcast_global_variables"]
    mean, want_mean, var, want_var = r0["sync bn"]
    assert mean == pytest.approx(want_mean, abs=1e-5) and var == pytest.approx(want_var, abs=1e-4)
    assert r1["sync bn"][0] == pytest.approx(want_mean, abs=1e-5)


def _elastic_keras_job(marker: str, epochs: int, steps: int) -> dict[str, Any]:
    import os
    import signal

    import keras
    import numpy as np

    import phalanx.tensorflow.keras as hvd

    hvd.init()
    rng = np.random.default_rng(0)
    x = rng.normal(size=(256, 6)).astype("float32")
    y = (x.sum(axis=1, keepdims=True) > 0).astype("float32")
    keras.utils.set_random_seed(1)
    model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(8, activation="relu"), keras.layers.Dense(1)])
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.05)), loss="mse")
    state = hvd.elastic.KerasState(model, batch=0, epoch=0)
    calls = [0]

    class Die(keras.callbacks.Callback):
        def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
            if hvd.rank() == 1 and state.epoch == 1 and batch == 2 and not os.path.exists(marker):
                Path(marker).write_text("killed")
                os.kill(os.getpid(), signal.SIGKILL)

    @hvd.elastic.run
    def train(state: Any) -> None:
        calls[0] += 1
        model.fit(x, y, batch_size=16, steps_per_epoch=steps, initial_epoch=state.epoch, epochs=epochs, verbose=0,
                  callbacks=[hvd.elastic.CommitStateCallback(state, batches_per_commit=2),
                             hvd.elastic.UpdateBatchStateCallback(state), hvd.elastic.UpdateEpochStateCallback(state),
                             Die()])

    train(state)
    from _keras_helpers import weights_agree

    return {"rank": hvd.rank(), "size": hvd.size(), "epoch": state.epoch, "calls": calls[0],
            "agree": weights_agree(hvd, model)}


@pytest.mark.timeout(240)
def test_elastic_keras_job_survives_a_sigkilled_rank(tmp_path: Path) -> None:
    helpers = str(Path(__file__).parent)
    marker = str(tmp_path / "killed")
    env = {**ENV, "PYTHONPATH": helpers, env_names.PHALANX_ELASTIC_TIMEOUT_S: "60"}
    out = phalanx.run(_elastic_keras_job, args=(marker, 3, 4), np=2, min_np=1, max_np=2, reset_limit=2, env=env)
    assert Path(marker).exists(), "rank 1 never died"
    assert [r["rank"] for r in out] == [0, 1] and all(r["size"] == 2 for r in out)
    assert all(r["epoch"] == 3 for r in out), out
    assert out[0]["calls"] == 2, out  # the survivor's train ran again after the reset
    assert all(r["agree"] for r in out), out
