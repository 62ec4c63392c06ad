"""Registration of ``"horovod"`` with a Lightning flavour's strategy registry, and the 1.x spelling.

Nothing here imports phalanx.torch: the registry holds a factory that builds the strategy class when a
``Trainer(strategy="horovod")`` first asks for it, so registering costs nothing in jobs that never use it.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable
from typing import Any

from phalanx.errors import InvalidArgumentError
from phalanx.lightning.flavours import FLAVOURS, STRATEGY_NAME, check_flavour

__all__ = ["FLAVOURS", "STRATEGY_NAME", "accept_v1_spelling", "check_flavour", "create", "register", "translate"]

_MARK = "__phalanx_horovod_spelling__"


def create(flavour: str, **init_params: Any) -> Any:
    """A new ``HorovodStrategy`` of ``flavour`` (what the registry calls for ``strategy="horovod"``)."""
    from phalanx.lightning.strategy import strategy_class

    return strategy_class(flavour)(**init_params)


def register(flavour: str) -> None:
    """Register ``"horovod"`` with ``flavour``'s ``StrategyRegistry`` and accept ``accelerator="horovod"``
    (idempotent; imports ``flavour`` if it is not yet imported).

    A strategy that some other package registered under the same name is left in place.

    Raises:
        InvalidArgumentError: ``flavour`` is not one of :data:`FLAVOURS`.
        ModuleNotFoundError: ``flavour`` is not installed.
    """
    strategies = importlib.import_module(f"{check_flavour(flavour)}.strategies")
    registry = strategies.StrategyRegistry
    if STRATEGY_NAME not in registry:
        registry.register(STRATEGY_NAME, functools.partial(create, flavour),
                          description="Horovod's API on torch.distributed (phalanx)")
    accept_v1_spelling(flavour)


def translate(kwargs: dict[str, Any]) -> dict[str, Any]:
    """The Trainer flags with Lightning 1.x's ``accelerator="horovod"`` rewritten as ``strategy="horovod"``
    (the device then chosen as for ``accelerator="auto"``).

    Raises:
        InvalidArgumentError: ``accelerator="horovod"`` together with another strategy.
    """
    accelerator = kwargs.get("accelerator")
    if not isinstance(accelerator, str) or accelerator.lower() != STRATEGY_NAME:
        return kwargs
    strategy = kwargs.get("strategy", "auto")
    if not (isinstance(strategy, str) and strategy.lower() in ("auto", STRATEGY_NAME)):
        raise InvalidArgumentError(
            f"Trainer(accelerator='horovod', strategy={strategy!r}): accelerator='horovod' is Lightning 1.x's "
            "spelling of the Horovod strategy and cannot be combined with another strategy; Lightning 2.x "
            "spells it Trainer(strategy=\"horovod\") (with accelerator='cpu', 'gpu' or 'auto')"
        )
    return {**kwargs, "accelerator": "auto", "strategy": STRATEGY_NAME}


def accept_v1_spelling(flavour: str) -> None:
    """Make ``flavour``'s Trainer take ``accelerator="horovod"`` (idempotent).

    The Trainer hands its flags to ``_AcceleratorConnector`` by keyword; its ``__init__`` is wrapped to
    :func:`translate` them. A Lightning without that class keeps its own error for the unknown accelerator.
    """
    module = importlib.import_module(f"{check_flavour(flavour)}.trainer.connectors.accelerator_connector")
    connector = getattr(module, "_AcceleratorConnector", None)
    original = getattr(connector, "__init__", None)
    if connector is None or original is None or getattr(original, _MARK, False):
        return
    connector.__init__ = _translating(original)


def _translating(original: Callable[..., None]) -> Callable[..., None]:
    @functools.wraps(original)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **translate(kwargs))

    setattr(__init__, _MARK, True)
    return __init__
