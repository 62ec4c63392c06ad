"""HorovodRunner with Keras: the classic Horovod Keras flow on Spark, logs streamed to the driver.

``train_keras`` is what Databricks' HorovodRunner documentation shows for TensorFlow/Keras:
``hvd.init()``, lr x ``hvd.size()``, ``hvd.DistributedOptimizer``, ``BroadcastGlobalVariablesCallback(0)``,
``MetricAverageCallback()``, ``steps_per_epoch`` divided by ``hvd.size()``, and sparkdl's ``LogCallback``,
which sends each epoch's metrics to the driver's console. ``--np 2`` runs 2 barrier tasks (with no active
SparkSession phalanx starts an embedded ``local[*]`` one); ``--np -2`` runs 2 processes on the driver.
Needs ``pip install 'phalanx[tensorflow,spark]'``. Nothing is downloaded.

    .venv/bin/python examples/keras_spark_digits.py [--np 2] [--epochs 4]
"""

from __future__ import annotations

import argparse
from typing import Any

from phalanx.spark import HorovodRunner


def train_keras(epochs: int = 4, batch_size: int = 32) -> dict[str, Any]:
    """The training function every rank runs; rank 0's return value reaches the driver."""
    import tensorflow as tf
    from _digits import keras_weights_agree, load_digits_numpy_split, make_keras_model

    import phalanx.tensorflow.keras as hvd  # or, unchanged: import horovod.tensorflow.keras as hvd
    from phalanx.spark.keras_log import LogCallback  # or: from sparkdl.horovod.tensorflow.keras import LogCallback

    hvd.init()
    x_train, y_train, x_test, y_test = load_digits_numpy_split()
    data = tf.data.Dataset.from_tensor_slices((x_train, y_train)).repeat().shuffle(1000, seed=hvd.rank())
    model = make_keras_model()
    opt = hvd.DistributedOptimizer(tf.keras.optimizers.Adam(0.001 * hvd.size()))
    model.compile(optimizer=opt, loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])
    callbacks: list[Any] = [hvd.callbacks.BroadcastGlobalVariablesCallback(0), hvd.callbacks.MetricAverageCallback()]
    if hvd.rank() == 0:
        callbacks.append(LogCallback())  # one line per epoch on the driver
    model.fit(data.batch(batch_size), steps_per_epoch=len(x_train) // (batch_size * hvd.size()), epochs=epochs,
              callbacks=callbacks, verbose=0)
    _, accuracy = model.evaluate(x_test, y_test, verbose=0)
    return {"accuracy": float(accuracy), "weights_agree": keras_weights_agree(hvd, model), "size": hvd.size()}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--np", type=int, default=2, help="ranks: N on Spark, -N on the driver (default 2)")
    parser.add_argument("--epochs", type=int, default=4)
    args = parser.parse_args(argv)
    result: dict[str, Any] = HorovodRunner(np=args.np).run(train_keras, epochs=args.epochs)
    where = "on Spark" if args.np > 0 else "on the driver"
    print(f"test accuracy: {result['accuracy']:.3f} ({result['size']} ranks {where}); "
          f"identical weights: {result['weights_agree']}")
    return result


if __name__ == "__main__":
    main()
