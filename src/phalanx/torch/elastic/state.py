"""What an elastic job keeps across a lost worker: ``State``, ``ObjectState``, ``TorchState``.

``commit()`` saves a copy in memory (and, with ``PHALANX_ELASTIC_CHECKPOINT_DIR``, on disk: rank 0
writes a temporary file and renames it over ``state.pt``, so a reader never sees half a file);
``restore()`` goes back to the last commit; ``sync()`` gives every rank rank 0's state.
"""

from __future__ import annotations

import copy
import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from phalanx.env import names as N
from phalanx.errors import HostsUpdatedInterrupt
from phalanx.torch import basics, functions
from phalanx.torch.elastic import _rendezvous

log = logging.getLogger(__name__)
CHECKPOINT_FILE = "state.pt"


def checkpoint_path() -> Path | None:
    """``$PHALANX_ELASTIC_CHECKPOINT_DIR/state.pt``, or None when durable commits are off."""
    folder = os.environ.get(N.PHALANX_ELASTIC_CHECKPOINT_DIR)
    return Path(folder) / CHECKPOINT_FILE if folder else None


def write_atomically(path: Path, value: Any) -> None:
    """``torch.save`` to a temporary file next to ``path``, then rename it over ``path``.

    Raises:
        OSError: the directory cannot be written.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    torch.save(value, tmp)
    os.replace(tmp, path)


class State:
    """Base class: reset callbacks, commit / check_host_updates; subclasses define save/restore/sync."""

    def __init__(self) -> None:
        self._reset_callbacks: list[Callable[[], None]] = []
        self.commits = 0

    def register_reset_callbacks(self, callbacks: list[Callable[[], None]]) -> None:
        """Call each of ``callbacks`` (no arguments) after every reset, once the new world is formed."""
        self._reset_callbacks.extend(callbacks)

    def on_reset(self) -> None:
        """Run the reset callbacks (called by ``hvd.elastic.run``)."""
        for callback in self._reset_callbacks:
            callback()

    def commit(self) -> None:
        """Save the state (memory, and disk when durable commits are on), then check for a new world.

        Raises:
            HostsUpdatedInterrupt: the driver published a new world since this one formed.
        """
        self.save()
        self.commits += 1
        path = checkpoint_path()
        if path is not None and basics.rank() == 0:
            write_atomically(path, self.durable())
        self.check_host_updates()

    def check_host_updates(self) -> None:
        """Raise :class:`HostsUpdatedInterrupt` when the driver has published a new world.

        Raises:
            HostsUpdatedInterrupt: a new round is waiting.
        """
        if _rendezvous.new_round_published():
            raise HostsUpdatedInterrupt(skip_sync=False)

    def save(self) -> None:
        """Keep a copy of the current state in memory."""
        raise NotImplementedError

    def restore(self) -> None:
        """Go back to the last saved copy."""
        raise NotImplementedError

    def sync(self) -> None:
        """Make every rank's state rank 0's (collective)."""
        raise NotImplementedError

    def durable(self) -> dict[str, Any]:
        """What a durable commit writes (a dict ``torch.save`` can store)."""
        raise NotImplementedError

    def load_durable(self, value: dict[str, Any]) -> None:
        """Adopt a dict :meth:`durable` wrote."""
        raise NotImplementedError

    def resume_from_checkpoint(self) -> bool:
        """On rank 0, load the durable checkpoint if there is one (before the first sync).

        Returns:
            True when a checkpoint was loaded.
        """
        path = checkpoint_path()
        if path is None or not path.exists() or basics.rank() != 0:
            return False
        self.load_durable(torch.load(path, weights_only=False))
        self.save()
        log.info("resumed elastic state from %s", path)
        return True


class ObjectState(State):
    """Plain Python attributes (``epoch=0, batch=0``...), broadcast from rank 0 by pickling.

    Args:
        **kwargs: the attributes and their initial values.
    """

    def __init__(self, **kwargs: Any) -> None:
        super().__init__()
        self._names = list(kwargs)
        for name, value in kwargs.items():
            setattr(self, name, value)
        self._saved: dict[str, Any] = {}
        self.save()

    def _values(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in self._names}

    def save(self) -> None:
        """Keep a deep copy of the attributes."""
        self._saved = copy.deepcopy(self._values())

    def restore(self) -> None:
        """Set the attributes back to the last saved copy."""
        for name, value in copy.deepcopy(self._saved).items():
            setattr(self, name, value)

    def sync(self) -> None:
        """Every rank takes rank 0's attributes (as currently set) and saves them."""
        values = functions.broadcast_object(self._values(), root_rank=0, name="elastic.object_state")
        for name, value in values.items():
            setattr(self, name, value)
        self.save()

    def durable(self) -> dict[str, Any]:
        """The attributes as last committed."""
        return {"objects": self._saved}

    def load_durable(self, value: dict[str, Any]) -> None:
        """Set the attributes from a checkpoint."""
        for name, item in value.get("objects", {}).items():
            setattr(self, name, item)


class TorchState(ObjectState):
    """A model, an optimizer and plain attributes (Horovod's ``TorchState``).

    Args:
        model: a ``torch.nn.Module`` (or None).
        optimizer: a ``torch.optim.Optimizer`` (or None).
        **kwargs: plain attributes, as in :class:`ObjectState`.
    """

    def __init__(self, model: torch.nn.Module | None = None, optimizer: torch.optim.Optimizer | None = None,
                 **kwargs: Any) -> None:
        self.model = model
        self.optimizer = optimizer
        self._model_saved: dict[str, Any] = {}
        self._opt_saved: dict[str, Any] = {}
        super().__init__(**kwargs)

    def save(self) -> None:
        """Deep-copy the model's and optimizer's state dicts and the attributes."""
        if self.model is not None:
            self._model_saved = copy.deepcopy(self.model.state_dict())
        if self.optimizer is not None:
            self._opt_saved = copy.deepcopy(self.optimizer.state_dict())
        super().save()

    def restore(self) -> None:
        """Load the last saved state dicts and attributes."""
        if self.model is not None and self._model_saved:
            self.model.load_state_dict(self._model_saved)
        if self.optimizer is not None and self._opt_saved:
            self.optimizer.load_state_dict(self._opt_saved)
        super().restore()

    def sync(self) -> None:
        """Broadcast rank 0's parameters, optimizer state and attributes; save them."""
        if self.model is not None:
            functions.broadcast_parameters(self.model.state_dict(), root_rank=0)
        if self.optimizer is not None:
            functions.broadcast_optimizer_state(self.optimizer, root_rank=0)
        super().sync()

    def durable(self) -> dict[str, Any]:
        """Model, optimizer and attributes as last committed."""
        return {"model": self._model_saved, "optimizer": self._opt_saved, **super().durable()}

    def load_durable(self, value: dict[str, Any]) -> None:
        """Load a checkpoint into the model, the optimizer and the attributes."""
        if self.model is not None and value.get("model"):
            self.model.load_state_dict(value["model"])
        if self.optimizer is not None and value.get("optimizer"):
            self.optimizer.load_state_dict(value["optimizer"])
        super().load_durable(value)
