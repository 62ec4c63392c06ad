"""Data, model and helpers shared by the examples: scikit-learn's handwritten digits, nothing downloaded.

Every example imports this module *inside* its training function, so it works on any rank: phalanx ships
the driver's ``sys.path`` (and, on Spark, the ``*.py`` files next to the driver's script) to the workers.
"""

from __future__ import annotations

import os
from typing import Any


def load_digits_split(seed: int = 0) -> tuple[Any, Any, Any, Any]:
    """1,797 8x8 images from scikit-learn, as float tensors (N, 1, 8, 8) in [0, 1], split 80/20.

    Returns:
        ``(x_train, y_train, x_test, y_test)``; the split is the same on every rank (fixed ``seed``).
    """
    import torch
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    x, y = load_digits(return_X_y=True)
    x_tr, x_te, y_tr, y_te = train_test_split(x / 16.0, y, test_size=0.2, random_state=seed, stratify=y)

    def as_tensors(a: Any, b: Any) -> tuple[Any, Any]:
        return torch.tensor(a, dtype=torch.float32).view(-1, 1, 8, 8), torch.tensor(b, dtype=torch.long)

    return (*as_tensors(x_tr, y_tr), *as_tensors(x_te, y_te))


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
    """``torch.save`` to a temporary file next to ``path``, then rename: no reader sees half a model."""
    import torch

    tmp = f"{path}.tmp-{os.getpid()}"
    torch.save(obj, tmp)
    os.replace(tmp, path)
