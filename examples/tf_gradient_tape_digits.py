"""A TensorFlow 2 custom training loop with Horovod's ``DistributedGradientTape``, on the digits.

The loop Horovod's TensorFlow 2 guide shows: ``hvd.init()``, each rank a shard of the data, the tape
wrapped after recording (``hvd.DistributedGradientTape(tape)``), the variables broadcast from rank 0 after
the first step (the optimizer's exist only then), and the loss averaged for reporting. Run it as

    phalanxrun -np 2 .venv/bin/python examples/tf_gradient_tape_digits.py [--epochs 3]
    .venv/bin/python examples/tf_gradient_tape_digits.py --np 2        # phalanx.run from this script

Needs ``pip install 'phalanx[tensorflow]'``. Nothing is downloaded.
"""

from __future__ import annotations

import argparse
import os
from typing import Any


def train(epochs: int = 3, batch_size: int = 32) -> dict[str, Any]:
    """The training function every rank runs; returns test accuracy, weight agreement and the rank."""
    import keras
    import tensorflow as tf
    from _digits import keras_weights_agree, load_digits_numpy_split, make_keras_model

    import phalanx.tensorflow as hvd  # or, unchanged: import horovod.tensorflow as hvd

    hvd.init()
    x_train, y_train, x_test, y_test = load_digits_numpy_split()
    keras.utils.set_random_seed(hvd.rank())  # different initial weights: the broadcast makes them rank 0's
    model = make_keras_model()
    opt = keras.optimizers.Adam(0.001 * hvd.size())
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    shard = tf.data.Dataset.from_tensor_slices((x_train, y_train)).shard(hvd.size(), hvd.rank())
    steps = len(x_train) // (batch_size * hvd.size())  # the same number of steps on every rank

    @tf.function(autograph=False)  # no Python control flow to convert
    def step(images: tf.Tensor, labels: tf.Tensor) -> tf.Tensor:
        with tf.GradientTape() as tape:
            loss = loss_fn(labels, model(images, training=True))
        tape = hvd.DistributedGradientTape(tape)
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    first = True
    for epoch in range(epochs):
        for images, labels in shard.shuffle(1000, seed=epoch).repeat().batch(batch_size).take(steps):
            loss = step(images, labels)
            if first:  # after the first step the optimizer's variables exist: make every rank rank 0's
                hvd.broadcast_variables(model.variables, root_rank=0)
                hvd.broadcast_variables(opt.variables, root_rank=0)
                first = False
        mean_loss = float(hvd.allreduce(loss, name="epoch loss"))
        if hvd.rank() == 0:
            print(f"epoch {epoch + 1}: loss {mean_loss:.4f}")
    logits = model(x_test, training=False)
    accuracy = float(tf.reduce_mean(tf.cast(tf.argmax(logits, axis=1) == y_test, tf.float32)))
    return {"accuracy": accuracy, "weights_agree": keras_weights_agree(hvd, model), "rank": hvd.rank(),
            "size": hvd.size()}


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--np", type=int, default=0, help="start N ranks with phalanx.run (0: this process is "
                        "already a rank, as under phalanxrun)")
    parser.add_argument("--epochs", type=int, default=3)
    args = parser.parse_args(argv)
    if args.np:
        import phalanx

        results: list[dict[str, Any]] = phalanx.run(train, kwargs={"epochs": args.epochs}, np=args.np,
                                                    env={"TF_CPP_MIN_LOG_LEVEL": "2"})
    else:
        os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
        results = [train(args.epochs)]
    if results[0]["rank"] == 0:
        print(f"test accuracy: {results[0]['accuracy']:.3f} ({results[0]['size']} ranks); "
              f"identical weights: {results[0]['weights_agree']}")
    return results


if __name__ == "__main__":
    main()
