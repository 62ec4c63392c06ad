"""Sharded checkpoints on any fsspec URL: every rank writes its own shards, any world size loads them.

``Checkpointer(url)`` saves with ``torch.distributed.checkpoint`` (DCP) through fsspec (a local path,
``file://``, ``s3://``, ``gs://``, ``hdfs://``...): each rank writes only the shards it holds (an FSDP2
model's ``DTensor`` parameters, a DeepSpeed-style partitioned state given as ``DTensor``/``ShardedTensor``;
replicated tensors are written once), and a load at another world size reads just the pieces each rank
now holds (DCP's resharding). Layout::

    <url>/step-0000000042/   .metadata  __0_0.distcp  __1_0.distcp ...  COMPLETE

**Completion marker.** ``COMPLETE`` is written by rank 0 after DCP's save returned, which is after every
rank's files and DCP's ``.metadata`` are written; a directory without it (a job killed while saving) is
never loaded, and is removed once a later step is complete.

**Asynchronous saves.** ``save(step, state, async_save=True)`` copies the state to CPU memory (the only
stall), returns, and writes in a background thread on a gloo group of its own (so its collectives never
interleave with training's); the next save, :meth:`Checkpointer.wait` and :meth:`Checkpointer.close`
wait for it. **Keep last k**: after marking a step complete, rank 0 removes the complete steps beyond
the newest ``keep_last``.

**Resume.** ``Checkpointer(url, resume=True).restore(state)`` loads the newest complete step into
``state`` (in place) and returns the step to continue from; ``resume=False`` starts at 0 whatever the
storage holds. Wrap a model and its optimizer in :class:`TrainState` (``get_state_dict`` /
``set_state_dict``: FSDP2, DDP and plain modules alike).
"""

from __future__ import annotations

import json
import logging
import posixpath
import re
import socket
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import torch
import torch.distributed as dist

from phalanx.errors import CheckpointError, InvalidArgumentError
from phalanx.torch._train import durable as _durable

log = logging.getLogger("phalanx")

MARKER = "COMPLETE"
_STEP_DIR = re.compile(r"^step-(\d{10})$")


def step_dir(step: int) -> str:
    """The directory name of ``step``."""
    return f"step-{step:010d}"


class TrainState:
    """A model, its optimizer and plain values as one DCP ``Stateful`` (torch's recommended AppState).

    Args:
        model: the module (FSDP2 ``fully_shard``-ed, DDP, or plain).
        optimizer: its optimizer, or None.
        **extra: plain values (a step, a loader's ``state_dict()``), saved and loaded as they are.
    """

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None,
                 **extra: Any) -> None:
        self.model, self.optimizer, self.extra = model, optimizer, dict(extra)

    def state_dict(self) -> dict[str, Any]:
        """``{"model": ..., "optim": ..., "extra": ...}`` with sharded tensors as DCP wants them."""
        from torch.distributed.checkpoint.state_dict import get_state_dict

        optimizers = [self.optimizer] if self.optimizer is not None else []
        model_sd, optim_sd = get_state_dict(self.model, optimizers)
        return {"model": model_sd, "optim": optim_sd, "extra": self.extra}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Load what :meth:`state_dict` saved (resharded by DCP for this world)."""
        from torch.distributed.checkpoint.state_dict import set_state_dict

        optimizers = [self.optimizer] if self.optimizer is not None else []
        set_state_dict(self.model, optimizers, model_state_dict=state["model"],
                       optim_state_dict=state["optim"] if optimizers else {})
        self.extra = dict(state.get("extra", {}))


class StepStore:
    """The steps under one URL: ``step-NNNNNNNNNN`` directories, complete once they hold ``COMPLETE`` (the
    module docstring). Shared by :class:`Checkpointer` and ``phalanx.torch.deepspeed_checkpoint``.

    Args:
        url: the directory: a local path or any fsspec URL.
        keep_last: complete steps kept (the newest); None keeps every one.
        storage_options: fsspec options.
    """

    def __init__(self, url: str, keep_last: int | None, storage_options: dict[str, Any] | None) -> None:
        if not isinstance(url, str) or not url:
            raise InvalidArgumentError(f"checkpoint url={url!r}: give a directory path or an fsspec URL")
        if keep_last is not None and (isinstance(keep_last, bool) or int(keep_last) < 1):
            raise InvalidArgumentError(f"keep_last={keep_last!r}: give a positive int, or None to keep every step")
        self.url = url.rstrip("/")
        self.keep_last = keep_last
        self.storage_options = dict(storage_options or {})
        self.fs, self.root = _filesystem(self.url, self.storage_options)
        self.local = _is_local(self.fs)

    def steps(self) -> list[int]:
        """The complete steps, oldest first."""
        return [s for s, complete in self.listing() if complete]

    def latest_step(self) -> int | None:
        """The newest complete step, or None."""
        done = self.steps()
        return done[-1] if done else None

    def listing(self) -> list[tuple[int, bool]]:
        """Every step directory, oldest first, with whether it is complete."""
        if not self.fs.exists(self.root):
            return []
        found = []
        for entry in self.fs.ls(self.root, detail=False):
            match = _STEP_DIR.match(posixpath.basename(str(entry).rstrip("/")))
            if match:
                step = int(match.group(1))
                found.append((step, bool(self.fs.exists(self.path(step, MARKER)))))
        return sorted(found)

    def path(self, step: int, *names: str) -> str:
        """The filesystem path of ``step`` (or of a file in it)."""
        return posixpath.join(self.root, step_dir(step), *names)

    def url_of(self, step: int, *names: str) -> str:
        """The URL of ``step`` (or of a file in it)."""
        return "/".join((self.url, step_dir(step), *names))

    def check_step(self, step: int) -> None:
        """Raises InvalidArgumentError: ``step`` is negative, or not newer than the newest complete step."""
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise InvalidArgumentError(f"step={step!r}: give a non-negative int")
        newest = self.latest_step()
        if newest is not None and step <= newest:
            raise InvalidArgumentError(
                f"step={step} is not newer than the newest complete checkpoint, step {newest}, under {self.url}: a "
                "complete step is never overwritten; save under a larger step (or restore() first)")

    def choose(self, step: int | None) -> int:
        """``step``, or the newest complete one.

        Raises:
            CheckpointError: no complete step (or ``step`` is not complete).
        """
        complete = self.steps()
        chosen = complete[-1] if step is None and complete else step
        if chosen is None or chosen not in complete:
            raise CheckpointError(f"no complete checkpoint{'' if step is None else f' step {step}'} under {self.url} "
                                  f"(complete steps: {complete}); a step without {MARKER} was not finished")
        return chosen

    def mark_complete(self, step: int, world_size: int) -> None:
        """Write ``step``'s marker durably, then drop the old and the abandoned steps (on one rank)."""
        record = {"step": step, "world_size": world_size, "time": time.time(), "host": socket.gethostname()}
        marker = self.path(step, MARKER) if self.local else self.url_of(step, MARKER)
        _durable.write_whole(marker, json.dumps(record).encode(), self.storage_options)
        self._prune(step)

    def _prune(self, newest: int) -> None:
        listing = self.listing()
        complete = [s for s, done in listing if done]
        drop = complete[:-self.keep_last] if self.keep_last else []
        drop += [s for s, done in listing if not done and s < newest]  # half-written by a job that died
        for step in drop:
            self.fs.rm(posixpath.join(self.root, step_dir(step)), recursive=True)


class Checkpointer:
    """Sharded, asynchronous, resumable checkpoints under ``url`` (see the module docstring).

    Create it on every rank at the same point (it may create a process group).

    Args:
        url: the checkpoints' directory: a local path or any fsspec URL.
        keep_last: complete steps kept (the newest); None keeps every one.
        resume: whether :meth:`restore` loads the newest complete step.
        storage_options: fsspec options (credentials, ``client_kwargs={"endpoint_url": ...}``).
    """

    def __init__(self, url: str, keep_last: int | None = 3, resume: bool = False,
                 storage_options: dict[str, Any] | None = None) -> None:
        self.store = StepStore(url, keep_last, storage_options)
        self.url, self.keep_last, self.resume = self.store.url, keep_last, bool(resume)
        self.storage_options = self.store.storage_options
        self._pending: Future[Any] | None = None
        self._group: Any = None

    # -- what the storage holds -----------------------------------------------------------------------
    def steps(self) -> list[int]:
        """The complete steps, oldest first."""
        return self.store.steps()

    def latest_step(self) -> int | None:
        """The newest complete step, or None."""
        return self.store.latest_step()

    # -- saving ---------------------------------------------------------------------------------------
    def save(self, step: int, state: dict[str, Any], async_save: bool = False) -> Future[Any] | None:
        """Save ``state`` (a dict of tensors, state dicts and ``Stateful`` objects) as ``step`` on every rank.

        Returns:
            With ``async_save``, a future done when the step is written and marked complete; else None.

        Raises:
            InvalidArgumentError: a negative step, or one not newer than the newest complete step.
            CheckpointError: a rank could not write (the error names the step's URL).
        """
        self.wait()
        self.store.check_step(step)
        from torch.distributed.checkpoint import async_save as dcp_async_save
        from torch.distributed.checkpoint import save as dcp_save

        writer = self._writer(step)
        try:
            if not async_save:
                dcp_save(state, storage_writer=writer)
                self._finish(step)
                return None
            response = dcp_async_save(state, storage_writer=writer, process_group=self._save_group())
        except Exception as e:  # DCP gathers every rank's failure into one CheckpointException
            raise CheckpointError(f"could not save checkpoint step {step} to {self.store.url_of(step)}: {e}") from e
        # the default stager (none given) returns the upload's Future itself, not an AsyncSaveResponse
        future: Future[Any] = response if isinstance(response, Future) else response.upload_completion
        self._pending = _then(future, lambda: self._finish(step))
        return self._pending

    def _writer(self, step: int) -> Any:
        from torch.distributed.checkpoint import FileSystemWriter
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

        if self.store.local:
            return FileSystemWriter(self.store.path(step))
        return FsspecWriter(self.store.url_of(step), **self.storage_options)

    def _save_group(self) -> Any:
        if self._group is None and dist.is_initialized():
            self._group = dist.new_group(backend="gloo")
        return self._group

    def _finish(self, step: int) -> None:
        """On rank 0: write the marker, then drop old and abandoned steps."""
        if dist.is_initialized() and dist.get_rank() != 0:
            return
        self.store.mark_complete(step, dist.get_world_size() if dist.is_initialized() else 1)

    def wait(self) -> None:
        """Wait for the pending asynchronous save (its error, if any, is raised here)."""
        pending, self._pending = self._pending, None
        if pending is not None:
            try:
                pending.result()
            except Exception as e:
                raise CheckpointError(f"the asynchronous checkpoint save under {self.url} failed: {e}") from e

    def close(self) -> None:
        """Wait for the pending save; release the save group."""
        self.wait()
        if self._group is not None:
            dist.destroy_process_group(self._group)
            self._group = None

    # -- loading --------------------------------------------------------------------------------------
    def load(self, state: dict[str, Any], step: int | None = None) -> int:
        """Load ``step`` (default: the newest complete one) into ``state`` in place, at this world size.

        Returns:
            The step loaded.

        Raises:
            CheckpointError: no complete step (or ``step`` is not complete).
        """
        from torch.distributed.checkpoint import FileSystemReader
        from torch.distributed.checkpoint import load as dcp_load
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

        chosen = self.store.choose(step)
        reader = (FileSystemReader(self.store.path(chosen)) if self.store.local
                  else FsspecReader(self.store.url_of(chosen), **self.storage_options))
        dcp_load(state, storage_reader=reader)
        log.info("loaded checkpoint step %d from %s", chosen, self.url)
        return chosen

    def restore(self, state: dict[str, Any]) -> int:
        """With ``resume=True`` and a complete step: load it into ``state`` and return it; else return 0.

        Every rank sees the same storage, so every rank takes the same branch.
        """
        if not self.resume or self.latest_step() is None:
            return 0
        return self.load(state)


def _then(future: Future[Any], finish: Callable[[], None]) -> Future[Any]:
    """A future done once ``future`` is done and ``finish()`` ran (its error, or ``future``'s, kept)."""
    done: Future[Any] = Future()

    def call(f: Future[Any]) -> None:
        try:
            f.result()
            finish()
            done.set_result(None)
        except BaseException as e:  # handed to whoever waits on the future
            done.set_exception(e)

    future.add_done_callback(call)
    return done


def _filesystem(url: str, storage_options: dict[str, Any]) -> tuple[Any, str]:
    try:
        import fsspec
    except ImportError as e:
        raise InvalidArgumentError("phalanx.torch.checkpoint needs fsspec: pip install fsspec (and s3fs, gcsfs... "
                                   "for object storage)") from e
    fs, root = fsspec.core.url_to_fs(url, **storage_options)
    return fs, str(root)


def _is_local(fs: Any) -> bool:
    protocol = fs.protocol if isinstance(fs.protocol, tuple) else (fs.protocol,)
    return "file" in protocol
