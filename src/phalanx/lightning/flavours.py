"""The Lightning packages phalanx serves and the strategy's registered name: the leaf that both the registry
and the strategy read (the registry builds the strategy lazily, so the strategy must not import it)."""

from __future__ import annotations

from phalanx.errors import InvalidArgumentError

#: The Lightning packages served: the unified ``lightning`` package's trainer, and the standalone one.
FLAVOURS = ("lightning.pytorch", "pytorch_lightning")
#: The name under which ``Trainer(strategy=...)`` finds the strategy (Lightning 1.x's name).
STRATEGY_NAME = "horovod"


def check_flavour(flavour: str) -> str:
    """``flavour`` if it is one of :data:`FLAVOURS`; raises :class:`InvalidArgumentError` otherwise."""
    if flavour not in FLAVOURS:
        raise InvalidArgumentError(f"unknown Lightning flavour {flavour!r}: use one of {', '.join(FLAVOURS)}")
    return flavour
