"""PyTorch Lightning's ``Trainer(strategy="horovod")`` on phalanx.torch (Lightning 2.x removed its own).

``import phalanx.lightning`` registers the strategy as ``"horovod"`` with every installed flavour of Lightning
(``lightning.pytorch`` and ``pytorch_lightning``): at once for a flavour already imported, else as soon as it is
imported. Inside a rank of a phalanx job this happens without the import (the worker entry and the wheel's
``phalanx-lightning.pth`` install :mod:`phalanx.lightning.hook`). Lightning 1.x's ``Trainer(accelerator="horovod")``
is accepted as ``strategy="horovod"``.

``HorovodStrategy`` is the class for ``lightning.pytorch`` (``pytorch_lightning``'s when only that is installed);
:func:`strategy_class` gives either flavour's. Importing this package imports neither Lightning nor torch.
"""

from __future__ import annotations

from typing import Any

from phalanx.lightning import hook
from phalanx.lightning.registry import FLAVOURS, STRATEGY_NAME, register

__all__ = ["FLAVOURS", "STRATEGY_NAME", "HorovodStrategy", "register", "strategy_class"]


def strategy_class(flavour: str | None = None) -> type:
    """The ``HorovodStrategy`` class of one flavour of Lightning.

    Args:
        flavour: ``"lightning.pytorch"`` or ``"pytorch_lightning"``; ``None``: the first one installed.

    Raises:
        ModuleNotFoundError: that flavour (or none) is installed.
        InvalidArgumentError: ``flavour`` is not one of :data:`FLAVOURS`.
    """
    from phalanx.lightning import strategy

    return strategy.strategy_class(flavour)


def __getattr__(name: str) -> Any:
    if name == "HorovodStrategy":
        return strategy_class()
    raise AttributeError(f"module 'phalanx.lightning' has no attribute {name!r}")


hook.install()
