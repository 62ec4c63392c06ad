"""Data, model and helpers shared by the examples: scikit-learn's handwritten digits, nothing downloaded.

Every example imports this module *inside* its training function, so it works on any rank: phalanx ships
the driver's ``sys.path`` (and, on Spark, the ``*.py`` files next to the driver's script) to the workers.
"""

from __future__ import annotations

import os
from typing import Any


def load_digits_arrays() -> tuple[Any, Any]:
    """scikit-learn's handwritten digits as numpy arrays: ``x`` (1797, 64) in 0..16, ``y`` (1797,) in 0..9.

    Reads the data file that ``sklearn.datasets.load_digits`` reads, without importing
    ``sklearn.datasets`` (which costs seconds of CPU on every rank); falls back to ``load_digits``.
    """
    import importlib.util
    from pathlib import Path

    import numpy as np

    spec = importlib.util.find_spec("sklearn")  # locates the package without importing it
    if spec is not None and spec.origin is not None:
        path = Path(spec.origin).parent / "datasets" / "data" / "digits.csv.gz"
        if path.is_file():
            data = np.loadtxt(path, delimiter=",")
            return data[:, :-1], data[:, -1].astype(np.int64)
    from sklearn.datasets import load_digits

    return load_digits(return_X_y=True)


def load_digits_split(seed: int = 0) -> tuple[Any, Any, Any, Any]:
    """The digits as float tensors (N, 1, 8, 8) in [0, 1], split 80/20 at random.

    Returns:
        ``(x_train, y_train, x_test, y_test)``: 1437 and 360 images; the same split on every rank (fixed
        ``seed``).
    """
    import torch

    x, y = load_digits_arrays()
    images = torch.tensor(x / 16.0, dtype=torch.float32).view(-1, 1, 8, 8)
    labels = torch.tensor(y, dtype=torch.long)
    order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(seed))
    train, test = order[: int(0.8 * len(order))], order[int(0.8 * len(order)) :]
    return images[train], labels[train], images[test], labels[test]


def make_model() -> Any:
    """A small CNN for 8x8 digits (~40k parameters)."""
    from torch import nn

    return nn.Sequential(
        nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(), nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(),
        nn.MaxPool2d(2), nn.Flatten(), nn.Linear(32 * 4 * 4, 64), nn.ReLU(), nn.Linear(64, 10),
    )


def accuracy(model: Any, x: Any, y: Any) -> float:
    """Fraction of ``x`` that ``model`` classifies as ``y`` (evaluated without gradients)."""
    import torch

    with torch.no_grad():
        return float((model(x).argmax(1) == y).float().mean().item())


def save_atomically(obj: Any, path: str) -> None:
    """``torch.save`` to a new private file next to ``path``, flushed to disk, then renamed over ``path``: no
    reader sees half a model, a crash leaves the old one, and in a shared directory such as /tmp nothing
    another user planted (a link at a guessable name) is written through."""
    import tempfile

    import torch

    folder = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", dir=folder)  # O_EXCL, mode 0600
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise
    dir_fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(dir_fd)  # the rename itself survives a power cut
    finally:
        os.close(dir_fd)


def load_digits_numpy_split(seed: int = 0) -> tuple[Any, Any, Any, Any]:
    """The digits as float32 numpy images (N, 8, 8, 1) in [0, 1] with int64 labels, split 80/20 at random
    (the same split on every rank), for the Keras examples (no torch import)."""
    import numpy as np

    x, y = load_digits_arrays()
    images = (x / 16.0).astype(np.float32).reshape(-1, 8, 8, 1)
    order = np.random.default_rng(seed).permutation(len(y))
    cut = int(0.8 * len(order))
    return images[order[:cut]], y[order[:cut]], images[order[cut:]], y[order[cut:]]


def make_keras_model() -> Any:
    """The small CNN of ``make_model`` in Keras (8x8x1 inputs, 10 logits), built with ``tf.keras``: the Keras
    TensorFlow chose (Keras 3, or ``tf_keras`` under ``TF_USE_LEGACY_KERAS=1``), as Horovod's examples do."""
    from tensorflow import keras

    return keras.Sequential([
        keras.Input((8, 8, 1)),
        keras.layers.Conv2D(16, 3, padding="same", activation="relu"),
        keras.layers.Conv2D(32, 3, padding="same", activation="relu"),
        keras.layers.MaxPooling2D(2), keras.layers.Flatten(),
        keras.layers.Dense(64, activation="relu"), keras.layers.Dense(10),
    ])


def keras_weights_agree(hvd: Any, model: Any) -> bool:
    """Whether every rank holds bit-identical weights (an allgather of each rank's weight bytes' hash)."""
    import hashlib

    import numpy as np

    digest = hashlib.sha256(b"".join(np.asarray(w).tobytes() for w in model.get_weights())).digest()
    mine = np.frombuffer(digest, dtype=np.int64).reshape(1, -1)
    every = np.asarray(hvd.allgather(mine, name="weights digest"))
    return bool((every == every[0]).all())
