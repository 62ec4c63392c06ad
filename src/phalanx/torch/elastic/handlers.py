"""Horovod's state-handler registry: how ``TorchState`` saves, restores and syncs typed attributes.

``TorchState(model=..., optimizer=..., **kwargs)`` gives every attribute whose value is an instance of a
registered type a handler (``torch.nn.Module`` -> :class:`ModelStateHandler`, ``torch.optim.Optimizer`` ->
:class:`OptimizerStateHandler`, :class:`ElasticSampler` -> :class:`SamplerStateHandler`, a loader that
declares ``elastic_resumable = True``, such as the Spark converter's, -> :class:`LoaderStateHandler`); the first
matching entry of the registry wins. Other attributes are plain objects (``ObjectState``). Add a type with
``set_handler_registry(get_handler_registry() + [(MyType, MyHandler)])``, as in Horovod.

A handler keeps its own saved copy: ``save()`` deep-copies the value's ``state_dict()``, ``restore()`` loads
it back, ``sync()`` makes every rank hold rank 0's state. phalanx adds :meth:`StateHandler.durable` /
:meth:`StateHandler.load_durable` for durable commits (``PHALANX_ELASTIC_CHECKPOINT_DIR``); a handler that
does not define them is not written to the checkpoint.
"""

from __future__ import annotations

import copy
from typing import Any

import torch

from phalanx.torch import basics, functions
from phalanx.torch.elastic.sampler import ElasticSampler


class StateHandler:
    """Saves, restores and syncs one attribute of a ``TorchState`` (Horovod's base class).

    Args:
        value: the object handled; ``self.value``.
    """

    def __init__(self, value: Any) -> None:
        self.value = value

    def save(self) -> None:
        """Keep a copy of the value's state."""
        raise NotImplementedError

    def restore(self) -> None:
        """Put the last saved copy back into the value."""
        raise NotImplementedError

    def sync(self) -> None:
        """Make every rank's value rank 0's (collective)."""
        raise NotImplementedError

    def set_value(self, value: Any) -> None:
        """The attribute was assigned a new object: handle it and save its state at once."""
        self.value = value
        self.save()

    def durable(self) -> Any:
        """What a durable commit writes for this attribute (None: nothing; phalanx's addition)."""
        return None

    def load_durable(self, saved: Any) -> None:
        """Adopt what :meth:`durable` wrote (phalanx's addition; does nothing by default)."""


class _StateDictHandler(StateHandler):
    """A handler for objects with ``state_dict()`` / ``load_state_dict()``."""

    def __init__(self, value: Any) -> None:
        super().__init__(value)
        self._saved: Any = copy.deepcopy(value.state_dict())

    def save(self) -> None:
        """Deep-copy the value's ``state_dict()``."""
        self._saved = copy.deepcopy(self.value.state_dict())

    def restore(self) -> None:
        """Load the saved ``state_dict``."""
        self.value.load_state_dict(self._saved)

    def durable(self) -> Any:
        """The state dict as last saved."""
        return self._saved

    def load_durable(self, saved: Any) -> None:
        """Load a checkpointed state dict and keep it as the saved copy."""
        self.value.load_state_dict(saved)
        self.save()


class ModelStateHandler(_StateDictHandler):
    """A ``torch.nn.Module``: its ``state_dict``; sync broadcasts rank 0's parameters and buffers."""

    def sync(self) -> None:
        """``broadcast_parameters(model.state_dict(), root_rank=0)``."""
        functions.broadcast_parameters(self.value.state_dict(), root_rank=0)


class OptimizerStateHandler(_StateDictHandler):
    """A ``torch.optim.Optimizer``: its ``state_dict``; sync is ``broadcast_optimizer_state`` from rank 0."""

    def sync(self) -> None:
        """``broadcast_optimizer_state(optimizer, root_rank=0)``."""
        functions.broadcast_optimizer_state(self.value, root_rank=0)


class SamplerStateHandler(_StateDictHandler):
    """An :class:`ElasticSampler`: its epoch and processed count; sync loads rank 0's."""

    def sync(self) -> None:
        """Load rank 0's ``state_dict`` (``broadcast_object``) on every rank."""
        self.value.load_state_dict(functions.broadcast_object(self.value.state_dict(), root_rank=0,
                                                              name="elastic.sampler_state"))


class _DeclaredResumable(type):
    def __instancecheck__(cls, value: Any) -> bool:
        return getattr(type(value), "elastic_resumable", False) is True


class ResumableLoader(metaclass=_DeclaredResumable):
    """What ``isinstance`` finds in any loader whose class sets ``elastic_resumable = True`` and has
    ``state_dict()``, ``load_state_dict(state)`` and ``set_shard(rank, size)``
    (``phalanx.spark.loader.DataLoader``)."""


class LoaderStateHandler(_StateDictHandler):
    """A :class:`ResumableLoader`: its position; sync loads rank 0's and re-splits for the new world."""

    def sync(self) -> None:
        """Load rank 0's position (``broadcast_object``), then read as this rank of the new size."""
        self.value.load_state_dict(functions.broadcast_object(self.value.state_dict(), root_rank=0,
                                                              name="elastic.loader_state"))
        self.value.set_shard(basics.rank(), basics.size())
        self.save()


Registry = list[tuple[type, type[StateHandler]]]

_registry: Registry = [
    (torch.nn.Module, ModelStateHandler),
    (torch.optim.Optimizer, OptimizerStateHandler),
    (ElasticSampler, SamplerStateHandler),
    (ResumableLoader, LoaderStateHandler),
]


def get_handler_registry() -> Registry:
    """The registry: ``[(type, handler class), ...]``, first match wins (the list itself, as in Horovod)."""
    return _registry


def set_handler_registry(registry: Registry) -> None:
    """Replace the registry used by ``TorchState`` objects created from now on."""
    global _registry
    _registry = registry


def handler_for(value: Any) -> StateHandler | None:
    """A new handler for ``value`` from the first registry entry it is an instance of, or None."""
    for kind, handler_cls in _registry:
        if isinstance(value, kind):
            return handler_cls(value)
    return None


def split(values: dict[str, Any]) -> tuple[dict[str, StateHandler], dict[str, Any]]:
    """Split attributes into those with a handler and the plain ones (Horovod's ``_get_handlers``)."""
    handlers: dict[str, StateHandler] = {}
    plain: dict[str, Any] = {}
    for name, value in values.items():
        handler = handler_for(value)
        if handler is not None:
            handlers[name] = handler
        else:
            plain[name] = value
    return handlers, plain
