"""Horovod's classic Keras example (``tensorflow2_keras_mnist.py``), on scikit-learn's digits, unchanged apart
from the data: ``import horovod.tensorflow.keras as hvd``.

It still passes ``experimental_run_tf_function=False`` to ``compile`` as Horovod's example did for TF 2.x;
Keras 3 removed that argument and phalanx silently drops it (a no-op). Everything Keras comes from
``tf.keras``, so it runs on Keras 3 and, with ``TF_USE_LEGACY_KERAS=1``, on Keras 2 (``tf_keras``). Run it as
under horovodrun:

    .venv/bin/phalanxrun -np 2 python examples/keras_horovod_train.py --epochs 4
    TF_USE_LEGACY_KERAS=1 .venv/bin/phalanxrun -np 2 python examples/keras_horovod_train.py --epochs 4

Needs ``pip install 'phalanx[tensorflow]'``. Rank 0 prints the test accuracy and saves the model.
"""

from __future__ import annotations

import argparse
import os
import tempfile
from typing import Any


def train(epochs: int = 4, batch_size: int = 32, out: str | None = None) -> dict[str, Any]:
    """Every rank runs this; returns the test accuracy and whether every rank ends with the same weights."""
    import horovod.tensorflow.keras as hvd
    import tensorflow as tf
    from _digits import keras_weights_agree, load_digits_numpy_split, make_keras_model

    hvd.init()
    x_train, y_train, x_test, y_test = load_digits_numpy_split()
    dataset = tf.data.Dataset.from_tensor_slices((x_train, y_train))
    dataset = dataset.repeat().shuffle(1000, seed=hvd.rank()).batch(batch_size)
    model = make_keras_model()
    scaled_lr = 0.001 * hvd.size()  # Horovod: scale the learning rate by the number of workers
    opt = hvd.DistributedOptimizer(tf.optimizers.Adam(scaled_lr))
    model.compile(loss=tf.losses.SparseCategoricalCrossentropy(from_logits=True), optimizer=opt,
                  metrics=["accuracy"], experimental_run_tf_function=False)
    callbacks = [
        hvd.callbacks.BroadcastGlobalVariablesCallback(0),  # the same initial weights everywhere
        hvd.callbacks.MetricAverageCallback(),
        hvd.callbacks.LearningRateWarmupCallback(initial_lr=scaled_lr, warmup_epochs=2, verbose=1),
    ]
    # Horovod: each rank sees 1/size of an epoch's batches; every rank must take the same number of steps.
    steps = len(x_train) // (batch_size * hvd.size())
    model.fit(dataset, steps_per_epoch=steps, callbacks=callbacks, epochs=epochs, verbose=2 if hvd.rank() == 0 else 0)
    _, accuracy = model.evaluate(x_test, y_test, verbose=0)
    agree = keras_weights_agree(hvd, model)
    if hvd.rank() == 0 and out:
        model.save(out)
    return {"accuracy": float(accuracy), "weights_agree": agree, "size": hvd.size(), "rank": hvd.rank()}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--out", default=os.path.join(tempfile.gettempdir(), "digits_keras.keras"),
                        help="where rank 0 saves the model (default: the temporary directory)")
    args = parser.parse_args(argv)
    result = train(epochs=args.epochs, out=os.path.abspath(args.out))
    if result["rank"] == 0:
        print(f"test accuracy: {result['accuracy']:.3f}; weights identical on {result['size']} ranks: "
              f"{result['weights_agree']}", flush=True)
    return result


if __name__ == "__main__":
    main()
