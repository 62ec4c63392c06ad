"""phalanx.tensorflow(.keras) in one process (one rank, no launcher): aliases, compile/fit patches, bad
arguments, and the error when TensorFlow is missing."""

from __future__ import annotations

import subprocess
import sys
import warnings
from collections.abc import Iterator

import pytest

pytest.importorskip("tensorflow")

import keras
import numpy as np

import phalanx.tensorflow.keras as hvd
from phalanx.errors import InvalidArgumentError


@pytest.fixture
def single(no_launcher: None) -> Iterator[None]:
    hvd.init()
    yield
    hvd.shutdown()


def _model() -> keras.Model:
    return keras.Sequential([keras.Input((3,)), keras.layers.Dense(2), keras.layers.Dense(1)])


def test_horovod_names_are_the_phalanx_modules() -> None:
    import horovod.keras
    import horovod.keras.callbacks
    import horovod.tensorflow
    import horovod.tensorflow.keras
    from sparkdl.horovod.tensorflow.keras import LogCallback

    import phalanx.tensorflow
    from phalanx.spark.keras_log import LogCallback as PhalanxLogCallback

    assert horovod.tensorflow.keras is hvd and horovod.keras is hvd and horovod.tensorflow is phalanx.tensorflow
    assert horovod.keras.callbacks is hvd.callbacks
    assert LogCallback is PhalanxLogCallback


def test_old_compile_argument_is_dropped_silently_and_jit_is_forced_off(single: None) -> None:
    model = _model()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # Horovod's examples pass it: accepted silently (a no-op in Keras 3)
        model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.1)), loss="mse",
                      experimental_run_tf_function=False)
    assert model.jit_compile is False
    with pytest.warns(UserWarning, match="XLA"):
        model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.1)), loss="mse", jit_compile=True)
    assert model.jit_compile is False
    history = model.fit(np.ones((8, 3), "float32"), np.ones((8, 1), "float32"), batch_size=4, epochs=2, verbose=0)
    assert len(history.history["loss"]) == 2
    plain = _model()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        plain.compile(optimizer="sgd", loss="mse", jit_compile=False)  # untouched without a distributed optimizer


def test_distributed_optimizer_keeps_class_and_config() -> None:
    opt = hvd.DistributedOptimizer(keras.optimizers.Adam(0.25, beta_1=0.8))
    assert isinstance(opt, keras.optimizers.Adam)
    assert opt.get_config()["beta_1"] == pytest.approx(0.8)
    assert float(opt.learning_rate) == pytest.approx(0.25)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [({"backward_passes_per_step": 0}, "backward_passes_per_step"), ({"op": 99}, "unknown reduce op"),
     ({"gradient_predivide_factor": 0.0}, "gradient_predivide_factor"), ({"num_groups": -1}, "num_groups"),
     ({"groups": 1.5}, "lists of variables"), ({"num_groups": 2, "groups": [[]]}, "not both")],
)
def test_bad_arguments_are_named(kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        hvd.DistributedOptimizer(keras.optimizers.SGD(0.1), **kwargs)  # type: ignore[arg-type]


def test_not_a_keras_optimizer_is_refused() -> None:
    with pytest.raises(InvalidArgumentError, match=r"keras\.optimizers\.Optimizer"):
        hvd.DistributedOptimizer(object())


def test_schedule_callbacks_set_the_learning_rate(single: None) -> None:
    model = _model()
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(1.0)), loss="mse")
    seen: list[float] = []
    lr = model.optimizer
    record = keras.callbacks.LambdaCallback(on_epoch_end=lambda e, logs: seen.append(float(lr.learning_rate)))
    schedule = hvd.callbacks.LearningRateScheduleCallback(initial_lr=0.5, multiplier=lambda epoch: 0.1 ** epoch)
    model.fit(np.ones((8, 3), "float32"), np.ones((8, 1), "float32"), batch_size=4, epochs=3, verbose=0,
              callbacks=[schedule, hvd.callbacks.MetricAverageCallback(), record])
    assert seen == pytest.approx([0.5, 0.05, 0.005])
    warm = hvd.callbacks.LearningRateWarmupCallback(initial_lr=0.3, warmup_epochs=2)
    model.fit(np.ones((8, 3), "float32"), np.ones((8, 1), "float32"), batch_size=4, epochs=2, verbose=0,
              callbacks=[warm])
    assert float(model.optimizer.learning_rate) == pytest.approx(0.3)  # size 1: warmup is flat


def test_gradient_groups_are_fused_separately(single: None, monkeypatch: pytest.MonkeyPatch) -> None:
    # white-box: the fused numpy allreduce and its layout, internal (no public name)
    from phalanx.tensorflow import _bridge

    seen: list[tuple[str, list[tuple[int, ...]]]] = []
    real = _bridge.np_fused_allreduce

    def record(arrays: list[np.ndarray], name: str, *args: object, **kwargs: object) -> list[np.ndarray]:
        seen.append((name, [a.shape for a in arrays]))
        return real(arrays, name, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(_bridge, "np_fused_allreduce", record)
    x, y = np.ones((4, 3), "float32"), np.ones((4, 1), "float32")
    model = _model()  # kernel (3, 2), bias (2,), kernel (2, 1), bias (1,)
    first, second = model.layers
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.1), groups=[[first.kernel, second.bias]]),
                  loss="mse")
    model.fit(x, y, batch_size=4, epochs=1, verbose=0)
    group = "DistributedOptimizer.gradients.group"
    assert seen == [(f"{group}0", [(3, 2), (1,)]), (f"{group}1", [(2,)]), (f"{group}2", [(2, 1)])]
    seen.clear()
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.1), num_groups=2), loss="mse")
    model.fit(x, y, batch_size=4, epochs=1, verbose=0)
    assert seen == [(f"{group}0", [(3, 2), (2,)]), (f"{group}1", [(2, 1), (1,)])]
    seen.clear()
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.1)), loss="mse")
    model.fit(x, y, batch_size=4, epochs=1, verbose=0)
    assert seen == [("DistributedOptimizer.gradients", [(3, 2), (2,), (2, 1), (1,)])]
    stranger = keras.Variable(np.zeros(2, "float32"), name="stranger")
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.1), groups=[[stranger]]), loss="mse")
    with pytest.raises(InvalidArgumentError, match=r"stranger.*does not train"):
        model.fit(x, y, batch_size=4, epochs=1, verbose=0)
    with pytest.raises(InvalidArgumentError, match="more than one group"):
        hvd.DistributedOptimizer(keras.optimizers.SGD(0.1), groups=[[first.kernel], [first.kernel]])


def _weight_after_lr_change(optimizer: keras.optimizers.Optimizer, correct: bool) -> float:
    """One weight, gradient 1, one step at lr 0.1 then one at lr 0.3 (Horovod: momentum x3 for that step)."""
    model = keras.Sequential([keras.Input((1,)), keras.layers.Dense(1, use_bias=False, kernel_initializer="zeros")])
    model.compile(optimizer=hvd.DistributedOptimizer(optimizer), loss=lambda t, p: keras.ops.mean(p))
    schedule = hvd.callbacks.LearningRateScheduleCallback(initial_lr=1.0, multiplier=lambda e: (0.1, 0.3)[int(e)],
                                                          momentum_correction=correct)
    model.fit(np.ones((1, 1), "float32"), np.zeros((1, 1), "float32"), batch_size=1, epochs=2, verbose=0,
              callbacks=[schedule])
    return float(model.get_weights()[0][0, 0])


def test_momentum_correction_matches_horovods_formula(single: None) -> None:
    # SGD: m1 = -0.1, w1 = -0.1; corrected m2 = 0.5 * 3 * m1 - 0.3 = -0.45 (uncorrected -0.35).
    assert _weight_after_lr_change(keras.optimizers.SGD(0.1, momentum=0.5), True) == pytest.approx(-0.55)
    assert _weight_after_lr_change(keras.optimizers.SGD(0.1, momentum=0.5), False) == pytest.approx(-0.45)
    # Nesterov: w1 = -0.15; corrected w2 = w1 + 1.5 * m2 - 0.3 with m2 = -0.45.
    nesterov = keras.optimizers.SGD(0.1, momentum=0.5, nesterov=True)
    assert _weight_after_lr_change(nesterov, True) == pytest.approx(-1.125)

    class Custom(keras.optimizers.Adam):
        momentum = 0.9

    with pytest.warns(UserWarning, match="momentum_correction is not applied to Custom"):
        _weight_after_lr_change(Custom(0.1), True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _weight_after_lr_change(keras.optimizers.Adam(0.1), True)  # no momentum: nothing to correct


def test_without_tensorflow_the_import_error_says_what_to_install() -> None:
    code = "import sys; sys.modules['tensorflow'] = None; import phalanx.tensorflow"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0
    assert "pip install 'phalanx[tensorflow]'" in proc.stderr


def test_fused_buffers_fold_an_exact_average_into_the_copy(single: None) -> None:
    import phalanx.torch as torch_hvd

    # white-box: the fused numpy allreduce and its layout, internal (no public name)
    from phalanx.tensorflow import _bridge

    f32, f16, i32 = np.dtype("float32"), np.dtype("float16"), np.dtype("int32")
    assert _bridge._folded_scale(torch_hvd.Average, 1.0, 4, f32) == 0.25
    assert _bridge._folded_scale(torch_hvd.Average, 1.0, 2, f16) == 0.5
    assert _bridge._folded_scale(torch_hvd.Average, 1.0, 3, f32) is None  # 1/3 is inexact: the engine divides the sum
    assert _bridge._folded_scale(torch_hvd.Average, 0.5, 2, f32) is None  # a prescale factor: left to the engine
    assert _bridge._folded_scale(torch_hvd.Sum, 1.0, 2, f32) is None
    assert _bridge._folded_scale(torch_hvd.Average, 1.0, 2, i32) is None  # integers: floor division of the sum
    arrays = [np.arange(5, dtype="float32"), np.ones((2, 3), "int32"), np.full((3,), 2.5, "float32")]
    layout = _bridge._layout(arrays, "g")
    assert _bridge._layout([a.copy() for a in arrays], "g") is layout  # cached per name, dtypes and shapes
    assert [(g.name, g.idx, g.starts, g.total) for g in layout] == [("g.float32", (0, 2), (0, 16), 32),
                                                                     ("g.int32", (1,), (0,), 16)]
    out = _bridge.np_fused_allreduce(arrays, "g", torch_hvd.Average, 1.0, 3.0)
    assert [o.tolist() for o in out] == [[0.0, 3.0, 6.0, 9.0, 12.0], [[3] * 3] * 2, [7.5] * 3]
    assert all(o.ctypes.data % _bridge.ALIGN_BYTES == 0 for o in out)


# Horovod 0.28.1's parameter lists (horovod/tensorflow/__init__.py, mpi_ops.py, functions.py, keras/__init__.py).
HOROVOD_TF_SIGNATURES = {
    "allreduce": ["tensor", "average", "device_dense", "device_sparse", "compression", "op", "prescale_factor",
                  "postscale_factor", "name", "process_set", "ignore_name_scope"],
    "grouped_allreduce": ["tensors", "average", "device_dense", "device_sparse", "compression", "op",
                          "prescale_factor", "postscale_factor", "process_set", "ignore_name_scope", "name"],
    "reducescatter": ["tensor", "device_dense", "compression", "op", "name", "process_set", "ignore_name_scope",
                      "prescale_factor", "postscale_factor"],
    "grouped_reducescatter": ["tensors", "device_dense", "compression", "op", "process_set", "prescale_factor",
                              "postscale_factor"],
    "allgather": ["tensor", "name", "ignore_name_scope", "process_set"],
    "grouped_allgather": ["tensors", "name", "ignore_name_scope", "process_set"],
    "broadcast": ["tensor", "root_rank", "name", "ignore_name_scope", "process_set"],
    "broadcast_": ["variables", "root_rank", "name", "process_set"],
    "alltoall": ["tensor", "splits", "name", "ignore_name_scope", "process_set"],
    "broadcast_variables": ["variables", "root_rank", "process_set", "inplace"],
    "broadcast_object": ["obj", "root_rank", "session", "name", "process_set"],
    "broadcast_object_fn": ["root_rank", "session", "name", "process_set"],
    "allgather_object": ["obj", "session", "name", "process_set"],
    "size_op": ["process_set_id", "name"],
    "process_set_included_op": ["process_set_id", "name"],
    "rank_op": ["name"],
    "DistributedOptimizer": ["optimizer", "name", "use_locking", "device_dense", "device_sparse", "compression",
                             "sparse_as_dense", "backward_passes_per_step", "op", "gradient_predivide_factor",
                             "average_aggregated_gradients", "num_groups", "groups", "process_set",
                             "scale_local_gradients"],
    "DistributedGradientTape": ["gradtape", "device_dense", "device_sparse", "compression", "sparse_as_dense", "op",
                                "gradient_predivide_factor", "num_groups", "groups", "process_set",
                                "scale_local_gradients"],
    "PartialDistributedGradientTape": ["gradtape", "device_dense", "device_sparse", "compression",
                                       "sparse_as_dense", "op", "gradient_predivide_factor", "num_groups", "groups",
                                       "process_set", "local_layers", "scale_local_gradients"],
}
HOROVOD_KERAS_SIGNATURES = {
    "allreduce": ["value", "name", "average", "prescale_factor", "postscale_factor", "op", "compression"],
    "allgather": ["value", "name"],
    "broadcast": ["value", "root_rank", "name"],
    "reducescatter": ["value", "name", "op"],
    "load_model": ["filepath", "custom_optimizers", "custom_objects", "compression", "legacy_opts"],
}


def _params(fn: object) -> list[str]:
    import inspect

    return list(inspect.signature(fn).parameters)  # type: ignore[arg-type]


@pytest.mark.parametrize("name", sorted(HOROVOD_TF_SIGNATURES))
def test_horovod_tensorflow_names_take_horovods_parameters(name: str) -> None:
    import phalanx.tensorflow as hvd_tf

    assert _params(getattr(hvd_tf, name))[: len(HOROVOD_TF_SIGNATURES[name])] == HOROVOD_TF_SIGNATURES[name]


@pytest.mark.parametrize("name", sorted(HOROVOD_KERAS_SIGNATURES))
def test_horovod_keras_names_take_horovods_parameters(name: str) -> None:
    assert _params(getattr(hvd, name))[: len(HOROVOD_KERAS_SIGNATURES[name])] == HOROVOD_KERAS_SIGNATURES[name]


def test_every_horovod_tensorflow_and_keras_name_exists() -> None:
    import horovod.tensorflow.keras.elastic as keras_elastic
    import horovod.tensorflow.mpi_ops as mpi_ops

    import phalanx.tensorflow as hvd_tf

    tf_names = {"DistributedGradientTape", "PartialDistributedGradientTape", "DistributedOptimizer",
                "BroadcastGlobalVariablesHook", "broadcast_global_variables", "LocalGradientAggregationHelper",
                "SyncBatchNormalization", "alltoall", "broadcast_", "grouped_allgather", "reducescatter",
                "grouped_reducescatter", "join", "allgather_object", "broadcast_object", "broadcast_object_fn",
                "rank_op", "local_rank_op", "size_op", "local_size_op", "process_set_included_op",
                "add_process_set", "remove_process_set", "gloo_built", "gloo_enabled", "nccl_built", "ddl_built",
                "ccl_built", "cuda_built", "rocm_built", "elastic"}
    assert not [n for n in tf_names if not hasattr(hvd_tf, n)]
    assert {"TensorFlowState", "TensorFlowKerasState", "run"} <= set(dir(hvd_tf.elastic))
    keras_names = {"reducescatter", "add_process_set", "remove_process_set", "gloo_built", "gloo_enabled",
                   "nccl_built", "ddl_built", "ccl_built", "cuda_built", "rocm_built", "PartialDistributedOptimizer"}
    assert not [n for n in keras_names if not hasattr(hvd, n)]
    assert hasattr(hvd.callbacks, "BestModelCheckpoint")
    assert {"KerasState", "CommitStateCallback", "UpdateBatchStateCallback", "UpdateEpochStateCallback",
            "run"} <= set(dir(keras_elastic))
    assert {"_allreduce", "handle_average_backwards_compatibility", "check_num_rank_power_of_2"} <= set(dir(mpi_ops))


def test_keras3_impossibilities_raise_with_the_way_out(single: None, tmp_path: object) -> None:
    with pytest.raises(InvalidArgumentError, match="Keras 3"):
        hvd.load_model("model.keras", legacy_opts=True)
    model = _model()
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.1)), loss="mse")
    with pytest.raises(InvalidArgumentError, match="filepath"):
        model.fit(np.zeros((4, 3)), np.zeros((4, 1)), verbose=0, callbacks=[hvd.callbacks.BestModelCheckpoint()])
    import phalanx.tensorflow as hvd_tf

    with pytest.raises(InvalidArgumentError, match="legacy TensorFlow"):
        hvd_tf.DistributedOptimizer(object())
    with pytest.raises(InvalidArgumentError, match="backward_passes_per_step"):
        hvd_tf.LocalGradientAggregationHelper(0, lambda g, v: g, False, False, 0, "optimizer_type_legacy")
    with pytest.raises(InvalidArgumentError, match=r"keras\.layers\.Layer"):
        hvd.PartialDistributedOptimizer(keras.optimizers.SGD(0.1), local_layers=[object()])


def test_best_model_checkpoint_keeps_the_best_epoch_on_rank_0(single: None, tmp_path: object) -> None:
    from pathlib import Path

    path = Path(str(tmp_path)) / "best.keras"
    model = _model()
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.01)), loss="mse")
    x = np.random.default_rng(0).normal(size=(16, 3)).astype("float32")
    model.fit(x, x[:, :1], validation_data=(x, x[:, :1]), epochs=2, verbose=0,
              callbacks=[hvd.callbacks.BestModelCheckpoint(monitor="val_loss", filepath=str(path))])
    assert path.is_file()


def test_horovod_tensorflow_util_and_executing_eagerly() -> None:
    import horovod.tensorflow as hvd_tf
    import tensorflow as tf
    from horovod.tensorflow.util import _cache, _executing_eagerly, _make_subgraph, refs_to_vars, vars_to_refs

    assert hvd_tf._executing_eagerly is _executing_eagerly and _executing_eagerly()
    seen = []
    assert tf.function(lambda: tf.constant(_executing_eagerly() or seen.append("graph") or 1))() == 1
    assert seen == ["graph"]
    assert int(_make_subgraph(lambda x: x * 2)(tf.constant(3))) == 6
    calls: list[int] = []
    doubled = _cache(lambda n: calls.append(n) or n * 2)
    assert (doubled(4), doubled(4), calls) == (8, 8, [4])
    variables = [tf.Variable(1.0), tf.Variable(2.0)]
    assert refs_to_vars(vars_to_refs(variables)) == variables and len(set(vars_to_refs(variables))) == 2


def test_a_narrow_inter_op_pool_warns_once_when_a_tf1_graph_gets_a_collective(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each collective waiting in a TF1 graph holds an inter-op thread: a user's narrow pool is kept but named
    (a tf.function's collectives run in order and need no spare threads: no warning there)."""
    import tensorflow as tf

    import phalanx.tensorflow as hvd_tf

    # white-box: the thread-pool warning's state, internal (no public name)
    from phalanx.tensorflow import _pools

    monkeypatch.setenv("TF_NUM_INTEROP_THREADS", "4")
    monkeypatch.setattr(_pools, "_WARNED", [False])
    monkeypatch.setattr(tf.config.threading, "get_inter_op_parallelism_threads", lambda: 0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        traced = tf.function(lambda x: hvd_tf.allreduce(x), autograph=False)  # autograph would only cost seconds
        traced.get_concrete_function(tf.TensorSpec([2], tf.float32))
    with tf.Graph().as_default():
        with pytest.warns(RuntimeWarning, match="inter-op pool has 4 threads"):
            hvd_tf.allreduce(tf.ones([2]))
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            hvd_tf.allreduce(tf.ones([2]))  # once
    monkeypatch.setenv("TF_NUM_INTEROP_THREADS", "64")
    monkeypatch.setattr(_pools, "_WARNED", [False])
    with tf.Graph().as_default(), warnings.catch_warnings():
        warnings.simplefilter("error")
        hvd_tf.allreduce(tf.ones([2]))
