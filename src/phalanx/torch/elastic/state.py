"""What an elastic job keeps across a lost worker: ``State``, ``ObjectState``, ``TorchState`` (Horovod's).

``commit()`` saves a copy in memory (and, with ``PHALANX_ELASTIC_CHECKPOINT_DIR``, a directory or any
fsspec URL, durably: rank 0 writes a temporary file, flushes it to the disk, renames it over ``state.pt``
and flushes the directory, so a reader never sees half a file and a commit survives a crash of the machine;
on an object store one PUT of the whole file);
``restore()`` goes back to the last commit; ``sync()`` gives every rank rank 0's state.

A checkpoint is loaded with ``torch.load(weights_only=True)``, torch's own default: tensors, containers
and plain values load; any other class an ``ObjectState`` attribute holds must be allowed first with
``torch.serialization.add_safe_globals`` (the error says which), so a checkpoint file cannot run code.
"""

from __future__ import annotations

import copy
import enum
import io
import logging
import pickle
import queue
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from phalanx.env import names as env_names
from phalanx.env import settings
from phalanx.errors import CheckpointError, HostsUpdatedInterrupt
from phalanx.torch import basics, functions
from phalanx.torch._train import durable as _durable
from phalanx.torch.elastic import _rendezvous, handlers
from phalanx.torch.elastic.handlers import (  # Horovod's names in horovod.torch.elastic.state
    ModelStateHandler,
    OptimizerStateHandler,
    SamplerStateHandler,
    StateHandler,
    get_handler_registry,
    set_handler_registry,
)

__all__ = ["HostUpdateResult", "ModelStateHandler", "ObjectState", "OptimizerStateHandler", "SamplerStateHandler",
           "State", "StateHandler", "TorchState", "get_handler_registry", "set_handler_registry"]

log = logging.getLogger(__name__)
CHECKPOINT_FILE = "state.pt"


def checkpoint_path() -> str | None:
    """``$PHALANX_ELASTIC_CHECKPOINT_DIR/state.pt`` (a path or an fsspec URL), or None when durable commits
    are off."""
    folder = settings.ELASTIC_CHECKPOINT_DIR.get()
    return f"{folder.rstrip('/')}/{CHECKPOINT_FILE}" if folder else None


def write_atomically(path: str | Path, value: Any) -> None:
    """``torch.save`` ``value`` to ``path`` whole and durably (``phalanx.torch._train.durable``: locally a flushed
    temporary file renamed over it, on an object store one PUT).

    Raises:
        CheckpointError: the file could not be written (a full disk, no permission, storage unreachable);
            no temporary file is left, and the message names the path and, locally, the space left.
    """
    target = str(path)
    buffer = io.BytesIO()
    try:
        torch.save(value, buffer)
        _durable.write_whole(target, buffer.getbuffer().tobytes())
    except Exception as e:  # OSError locally, RuntimeError from torch.save, an object store client's own
        raise CheckpointError(
            f"could not write the elastic checkpoint {target} ({_free(target)} free on its filesystem): "
            f"{e}; free some space or point {env_names.PHALANX_ELASTIC_CHECKPOINT_DIR} elsewhere"
        ) from e


def _free(target: str) -> str:
    if _durable.is_url(target):
        return "unknown space"
    try:
        return f"{shutil.disk_usage(Path(_durable.local_path(target)).parent).free / 2**20:.1f} MiB"
    except OSError:
        return "unknown space"


def read_checkpoint(path: str | Path) -> dict[str, Any] | None:
    """Load a checkpoint with ``weights_only=True``; None when there is none.

    Raises:
        CheckpointError: the file holds a class that was not allowed (the message names it and the
            fix), or cannot be read.
    """
    data = _durable.read_bytes(str(path))
    if data is None:
        return None
    try:
        value: dict[str, Any] = torch.load(io.BytesIO(data), weights_only=True)
    except pickle.UnpicklingError as e:
        raise CheckpointError(
            f"the elastic checkpoint {path} holds objects torch.load(weights_only=True) does not load: {e}"
        ) from e
    return value


class HostUpdateResult(enum.IntFlag):
    """What a host update did (Horovod's values): hosts removed, added, or both."""

    no_update = 0
    removed = 1
    added = 2
    mixed = removed | added


class State:
    """Base class: reset callbacks, ``commit`` and the host-update check; subclasses save/restore/sync.

    Args:
        bcast_object: broadcasts a picklable object from rank 0 (default: ``hvd.broadcast_object``).
        get_rank: returns this rank (default: ``hvd.rank``).
    """

    def __init__(self, bcast_object: Callable[[Any], Any] | None = None,
                 get_rank: Callable[[], int] | None = None) -> None:
        self._bcast_object = bcast_object or _broadcast_from_rank0
        self._rank = get_rank or basics.rank
        self._host_messages: queue.Queue[tuple[float, int]] = queue.Queue()
        self._last_updated_timestamp = 0.0
        self._reset_callbacks: list[Callable[[], None]] = []
        self.commits = 0

    def register_reset_callbacks(self, callbacks: list[Callable[[], None]]) -> None:
        """Call each of ``callbacks`` (no arguments) after every reset, once the new world is formed."""
        self._reset_callbacks.extend(callbacks)

    def on_reset(self) -> None:
        """After a reset (called by ``hvd.elastic.run``): forget pending host messages, :meth:`reset`, then
        run the reset callbacks."""
        self._host_messages = queue.Queue()
        self.reset()
        for callback in self._reset_callbacks:
            callback()

    def reset(self) -> None:
        """Reset objects and variables after a reset event, before the state is synced (override it)."""

    def on_hosts_updated(self, timestamp: float, update_res: int) -> None:
        """Record a host-update notification; the next :meth:`check_host_updates` raises for it.

        Horovod's driver calls it on every worker; phalanx's driver publishes new worlds in the job's store
        instead, which :meth:`check_host_updates` also reads. A notification is this rank's alone: call it
        on every rank (Horovod broadcasts rank 0's view at each commit).

        Args:
            timestamp: when the update happened; only one newer than the last handled counts.
            update_res: a :class:`HostUpdateResult` (``removed`` alone lets the interrupt skip the sync).
        """
        self._host_messages.put((timestamp, int(update_res)))

    def commit(self) -> None:
        """Save the state (memory, and disk when durable commits are on), then check for a new world.

        Raises:
            HostsUpdatedInterrupt: the driver published a new world since this one formed.
        """
        self.save()
        self.commits += 1
        path = checkpoint_path()
        if path is not None and self._rank() == 0:
            write_atomically(path, self.durable())
        self.check_host_updates()

    def check_host_updates(self) -> None:
        """Raise :class:`HostsUpdatedInterrupt` when hosts were updated: a notification newer than the last
        one handled (``skip_sync`` when hosts were only removed, as in Horovod), or a new world the driver
        published.

        Raises:
            HostsUpdatedInterrupt: a new round is waiting.
        """
        newest, update = self._last_updated_timestamp, HostUpdateResult.no_update
        while not self._host_messages.empty():
            timestamp, result = self._host_messages.get()
            if timestamp > newest:
                newest, update = timestamp, update | HostUpdateResult(result)
        if newest > self._last_updated_timestamp:
            self._last_updated_timestamp = newest
            raise HostsUpdatedInterrupt(skip_sync=update == HostUpdateResult.removed)
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
        if path is None or self._rank() != 0:
            return False
        saved = read_checkpoint(path)
        if saved is None:
            return False
        self.load_durable(saved)
        self.save()
        log.info("resumed elastic state from %s", path)
        return True


def _broadcast_from_rank0(value: Any) -> Any:
    return functions.broadcast_object(value, root_rank=0, name="elastic.object_state")


class ObjectState(State):
    """Plain Python attributes (``epoch=0, batch=0``...), broadcast from rank 0 by pickling.

    Horovod's signature: ``ObjectState(bcast_object, get_rank, **kwargs)``; both functions may be left out
    (``ObjectState(epoch=0)``: ``hvd.broadcast_object`` and ``hvd.rank``).

    Args:
        bcast_object: broadcasts a picklable object from rank 0.
        get_rank: returns this rank.
        **kwargs: the attributes and their initial values (the first saved state).
    """

    def __init__(self, bcast_object: Callable[[Any], Any] | None = None, get_rank: Callable[[], int] | None = None,
                 **kwargs: Any) -> None:
        self._saved: dict[str, Any] = copy.deepcopy(kwargs)
        self._set_attrs()
        super().__init__(bcast_object=bcast_object, get_rank=get_rank)

    def _set_attrs(self) -> None:
        for name, value in copy.deepcopy(self._saved).items():
            setattr(self, name, value)

    def save(self) -> None:
        """Keep a deep copy of the attributes."""
        self._saved = copy.deepcopy({name: getattr(self, name) for name in self._saved})

    def restore(self) -> None:
        """Set the attributes back to the last saved copy."""
        self._set_attrs()

    def sync(self) -> None:
        """Every rank takes rank 0's last saved attributes (Horovod's rule: uncommitted changes are not
        synced)."""
        if self._saved:
            self._saved = self._bcast_object(self._saved)
            self._set_attrs()

    def durable(self) -> dict[str, Any]:
        """The attributes as last committed."""
        return {"objects": self._saved}

    def load_durable(self, value: dict[str, Any]) -> None:
        """Set the attributes from a checkpoint."""
        for name, item in value.get("objects", {}).items():
            if name in self._saved:  # an attribute of this state (a handled one is loaded by its handler)
                setattr(self, name, item)


class TorchState(ObjectState):
    """Models, optimizers, samplers and plain attributes (Horovod's ``TorchState``).

    Every keyword argument becomes an attribute. One whose value has a handler in the registry
    (``phalanx.torch.elastic.handlers``: modules, optimizers, :class:`ElasticSampler`) is saved, restored
    and synced by it; assigning a new object to such an attribute hands it to the handler and saves it.
    The others are plain objects, as in :class:`ObjectState`.

    Args:
        model: a ``torch.nn.Module`` (or None).
        optimizer: a ``torch.optim.Optimizer`` (or None).
        **kwargs: more attributes.
    """

    def __init__(self, model: torch.nn.Module | None = None, optimizer: torch.optim.Optimizer | None = None,
                 **kwargs: Any) -> None:
        kwargs.update(model=model, optimizer=optimizer)
        self._handlers, plain = handlers.split(kwargs)
        for name, handler in self._handlers.items():
            setattr(self, name, handler.value)
        super().__init__(bcast_object=_broadcast_from_rank0, get_rank=basics.rank, **plain)

    def __setattr__(self, name: str, value: Any) -> None:
        if name in getattr(self, "_handlers", {}) and hasattr(self, name):
            self._handlers[name].set_value(value)
        super().__setattr__(name, value)

    def save(self) -> None:
        """Save every handled attribute, then the plain ones."""
        for handler in self._handlers.values():
            handler.save()
        super().save()

    def restore(self) -> None:
        """Restore every handled attribute, then the plain ones."""
        for handler in self._handlers.values():
            handler.restore()
        super().restore()

    def sync(self) -> None:
        """Sync every handled attribute from rank 0 (parameters, optimizer state, sampler), then the plain
        ones."""
        for handler in self._handlers.values():
            handler.sync()
        super().sync()

    def durable(self) -> dict[str, Any]:
        """Handled attributes (those whose handler has a durable form) and plain ones as last committed."""
        saved = {name: h.durable() for name, h in self._handlers.items()}
        return {"handlers": {name: v for name, v in saved.items() if v is not None}, **super().durable()}

    def load_durable(self, value: dict[str, Any]) -> None:
        """Load a checkpoint into the handled attributes and the plain ones."""
        saved_by = value.get("handlers") or {k: value[k] for k in ("model", "optimizer") if value.get(k)}
        for name, saved in saved_by.items():
            if name in self._handlers:
                self._handlers[name].load_durable(saved)
        super().load_durable(value)
