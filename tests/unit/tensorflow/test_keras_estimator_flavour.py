"""KerasEstimator's Keras-dependent pieces in a Keras 3 process: which Keras the ranks get, a ``.keras`` file
loaded by the Keras that wrote it (a ``tf_keras`` model's too, as a ``transform`` task without
``TF_USE_LEGACY_KERAS`` does), and the errors when a model is not of the Keras ``tf.keras`` is. Keras 2's side
(a ``tf_keras`` model trained under ``TF_USE_LEGACY_KERAS=1``) is in tests/multiprocess/tensorflow/test_keras2.py.
"""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("tensorflow")
pytest.importorskip("pyspark")
pytest.importorskip("tf_keras")

import keras
import tf_keras

from phalanx.errors import InvalidArgumentError
from phalanx.spark.estimator import keras_remote
from phalanx.spark.keras import KerasEstimator


def _tf_keras_model() -> object:
    return tf_keras.Sequential([tf_keras.layers.Dense(2, input_shape=(3,), kernel_initializer="ones")])


def _keras3_model() -> keras.Model:
    return keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])


def test_each_keras_gets_its_own_tf_keras_on_the_ranks() -> None:
    assert keras_remote.rank_env(keras) == {"TF_USE_LEGACY_KERAS": "0"}
    assert keras_remote.rank_env(tf_keras) == {"TF_USE_LEGACY_KERAS": "1"}
    est = KerasEstimator(model=_tf_keras_model())
    assert est.rank_env() == {"TF_USE_LEGACY_KERAS": "1"}
    assert KerasEstimator(model=_keras3_model()).rank_env() == {"TF_USE_LEGACY_KERAS": "0"}


def test_a_keras_file_loads_with_the_keras_that_wrote_it() -> None:
    data = keras_remote.save_model(_tf_keras_model())
    assert keras_remote.saved_by(data) is tf_keras
    model = keras_remote.load_model(data, None)
    assert isinstance(model, tf_keras.Model)
    assert np.asarray(model(np.ones((1, 3), np.float32))).tolist() == [[3.0, 3.0]]
    assert keras_remote.saved_by(keras_remote.save_model(_keras3_model())) is keras
    with pytest.raises(InvalidArgumentError, match=r"not a \.keras model file"):
        keras_remote.saved_by(b"not a zip")


def test_a_rank_whose_tf_keras_did_not_build_the_model_says_how_to_choose() -> None:
    with pytest.raises(InvalidArgumentError, match=r"tf_keras model but this rank's tf.keras is Keras 3.*"
                                                   r"TF_USE_LEGACY_KERAS=1"):
        keras_remote._rank_keras(keras_remote.save_model(_tf_keras_model()))


def test_a_model_or_optimizer_of_the_other_keras_is_refused_with_the_fix() -> None:
    values = {"model": _tf_keras_model(), "optimizer": keras.optimizers.SGD(0.1), "loss": "mse"}
    with pytest.raises(InvalidArgumentError, match=r"model=tf_keras\..*Sequential: give a keras.Model "
                                                   r"\(tf.keras is Keras 3.*TF_USE_LEGACY_KERAS=1"):
        KerasEstimator().check_framework(values)
    values.update(model=_keras3_model(), optimizer=tf_keras.optimizers.legacy.SGD(0.1))
    with pytest.raises(InvalidArgumentError, match=r"optimizer=tf_keras\..*SGD: give a keras.optimizers"):
        KerasEstimator().check_framework(values)
    values.update(optimizer=keras.optimizers.SGD(0.1))
    KerasEstimator().check_framework(values)
