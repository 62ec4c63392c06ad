"""DeepSpeed's own checkpoint format (``engine.save_checkpoint`` / ``load_checkpoint``) on any fsspec URL,
with the storage rules of ``phalanx.torch.checkpoint``: a completion marker, keep the last k, durable files.

DeepSpeed writes with ``torch.save`` to local paths only. So every rank has the engine save into a staging
directory of its own (each rank writes just its files: ZeRO's ``zero_pp_rank_R_..._optim_states.pt`` and,
under ZeRO-3, its ``..._model_states.pt``; data-parallel rank 0 also the module's ``mp_rank_00_model_states.pt``),
then moves them into the step's directory: on a local disk by renaming each file after flushing it (the
staging directory sits under the target, so nothing is copied), elsewhere by uploading it (one PUT, visible
whole). Every rank reports its outcome to all (one collective, so a failed rank is named and nobody hangs);
then rank 0 writes ``COMPLETE`` and DeepSpeed's ``latest`` (the step's tag), and drops the steps beyond
``keep_last``. The result is DeepSpeed's own layout, so a copy of the directory loads with
``engine.load_checkpoint(dir)`` and converts with DeepSpeed's ``zero_to_fp32.py``::

    <url>/latest                         "step-0000000042"
    <url>/step-0000000042/  mp_rank_00_model_states.pt  zero_pp_rank_0_mp_rank_00_optim_states.pt  ...  COMPLETE

Loading takes the newest complete step (or the one asked for): from a local disk in place, from elsewhere
by downloading the step into a staging directory (every rank reads every rank's ZeRO files, as DeepSpeed's
loader does). DeepSpeed loads at the world size it saved at; a load at another data-parallel size is
DeepSpeed's "universal checkpoint" conversion (``ds_to_universal.py``), not done here.
"""

from __future__ import annotations

import logging
import os
import posixpath
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch.distributed as dist

from phalanx.errors import CheckpointError
from phalanx.torch._train import durable as _durable
from phalanx.torch.checkpoint import StepStore, step_dir

log = logging.getLogger("phalanx")

LATEST = "latest"
_STAGING_PREFIX = ".staging-"


class DeepSpeedCheckpointer:
    """DeepSpeed checkpoints of a ``deepspeed.initialize`` engine under ``url`` (the module docstring).

    Create it on every rank; call :meth:`save` and :meth:`load` / :meth:`restore` on every rank.

    Args:
        url: the checkpoints' directory: a local path or any fsspec URL (``s3://bucket/run``).
        keep_last: complete steps kept (the newest); None keeps every one.
        resume: whether :meth:`restore` loads the newest complete step.
        storage_options: fsspec options (credentials, endpoint).
        staging_dir: where a rank stages a step on its way to or from object storage (default: the
            system's temporary directory). A local ``url`` stages under itself.
    """

    def __init__(self, url: str, keep_last: int | None = 3, resume: bool = False,
                 storage_options: dict[str, Any] | None = None, staging_dir: str | None = None) -> None:
        self.store = StepStore(url, keep_last, storage_options)
        self.url, self.resume, self.staging_dir = self.store.url, bool(resume), staging_dir

    def steps(self) -> list[int]:
        """The complete steps, oldest first."""
        return self.store.steps()

    def latest_step(self) -> int | None:
        """The newest complete step, or None."""
        return self.store.latest_step()

    # -- saving ---------------------------------------------------------------------------------------
    def save(self, engine: Any, step: int, client_state: dict[str, Any] | None = None,
             exclude_frozen_parameters: bool = False) -> None:
        """``engine.save_checkpoint`` as ``step`` (tag ``step-NNNNNNNNNN``), on every rank.

        Raises:
            InvalidArgumentError: a negative step, or one not newer than the newest complete step.
            CheckpointError: a rank could not write (named, with the step's URL); the step stays incomplete.
        """
        self.store.check_step(step)
        tag = step_dir(step)
        if _rank() == 0 and self.store.fs.exists(self.store.path(step)):  # half-written by a job that died
            self.store.fs.rm(self.store.path(step), recursive=True)  # (DeepSpeed's first barrier orders this)
        staging = self._staging()
        try:
            error = _attempt(lambda: self._save_here(engine, staging, tag, client_state or {},
                                                     exclude_frozen_parameters))
            _raise_any(_gather(error), f"could not save DeepSpeed checkpoint step {step} to {self.store.url_of(step)}")
            error = _attempt(lambda: self._finish(step, tag)) if _rank() == 0 else None
            _raise_any(_gather(error), f"could not mark DeepSpeed checkpoint step {step} under {self.url} complete")
        finally:
            shutil.rmtree(staging, ignore_errors=True)

    def _save_here(self, engine: Any, staging: str, tag: str, client_state: dict[str, Any],
                   exclude_frozen_parameters: bool) -> None:
        engine.save_checkpoint(staging, tag=tag, client_state=client_state, save_latest=False,
                               exclude_frozen_parameters=exclude_frozen_parameters)
        for source in sorted(p for p in Path(staging).rglob("*") if p.is_file()):
            relative = source.relative_to(staging).as_posix()
            if self.store.local:
                _move_durably(str(source), posixpath.join(self.store.root, relative))
            else:
                self.store.fs.put_file(str(source), posixpath.join(self.store.root, relative))

    def _finish(self, step: int, tag: str) -> None:
        self.store.mark_complete(step, dist.get_world_size() if dist.is_initialized() else 1)
        latest = posixpath.join(self.store.root, LATEST) if self.store.local else f"{self.url}/{LATEST}"
        _durable.write_whole(latest, tag.encode(), self.store.storage_options)
        if self.store.local:  # every rank's files are in place: what is left in staging is a dead job's
            for left in Path(self.store.root).glob(f"{_STAGING_PREFIX}*"):
                shutil.rmtree(left, ignore_errors=True)

    def _staging(self) -> str:
        if self.store.local:  # under the target: a rename moves a file into place
            os.makedirs(self.store.root, exist_ok=True)
            return tempfile.mkdtemp(prefix=f"{_STAGING_PREFIX}{_rank()}-", dir=self.store.root)
        return tempfile.mkdtemp(prefix=f"phalanx-deepspeed-{_rank()}-", dir=self.staging_dir)

    # -- loading --------------------------------------------------------------------------------------
    def load(self, engine: Any, step: int | None = None, **load_checkpoint_kwargs: Any) -> tuple[int, dict[str, Any]]:
        """``engine.load_checkpoint`` of ``step`` (default: the newest complete one), on every rank.

        Args:
            load_checkpoint_kwargs: passed to ``engine.load_checkpoint`` (``load_optimizer_states``,
                ``load_lr_scheduler_states``, ``load_module_only``...).

        Returns:
            The step loaded and the ``client_state`` it was saved with.

        Raises:
            CheckpointError: no complete step (or ``step`` is not complete), or DeepSpeed found nothing to load.
        """
        chosen = self.store.choose(step)
        tag = step_dir(chosen)
        staging = None
        try:
            if self.store.local:
                folder = self.store.root
            else:
                staging = folder = tempfile.mkdtemp(prefix=f"phalanx-deepspeed-{_rank()}-", dir=self.staging_dir)
                self.store.fs.get(self.store.path(chosen), os.path.join(staging, tag), recursive=True)
            path, client_state = engine.load_checkpoint(folder, tag=tag, **load_checkpoint_kwargs)
        finally:
            if staging is not None:
                shutil.rmtree(staging, ignore_errors=True)
        if path is None:
            raise CheckpointError(f"DeepSpeed found no checkpoint to load in step {chosen} under {self.url}")
        log.info("loaded DeepSpeed checkpoint step %d from %s", chosen, self.url)
        return chosen, dict(client_state or {})

    def restore(self, engine: Any, **load_checkpoint_kwargs: Any) -> tuple[int, dict[str, Any]]:
        """With ``resume=True`` and a complete step: :meth:`load` it; else ``(0, {})``. Every rank sees the
        same storage, so every rank takes the same branch."""
        if not self.resume or self.latest_step() is None:
            return 0, {}
        return self.load(engine, **load_checkpoint_kwargs)


def _move_durably(source: str, target: str) -> None:
    """``source`` renamed to ``target`` (same filesystem), both flushed to the disk."""
    folder = os.path.dirname(target)
    os.makedirs(folder, exist_ok=True)
    fd = os.open(source, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(source, target)
    _durable.fsync_dir(folder)


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _attempt(action: Any) -> str | None:
    try:
        action()
    except Exception as e:  # reported to every rank by _gather, raised there with the rank named
        return f"{type(e).__name__}: {e}"
    return None


def _gather(error: str | None) -> list[str | None]:
    if not dist.is_initialized():
        return [error]
    errors: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(errors, error)
    return errors


def _raise_any(errors: list[str | None], what: str) -> None:
    failed = [(rank, e) for rank, e in enumerate(errors) if e is not None]
    if failed:
        rank, error = failed[0]
        others = f" (and {len(failed) - 1} more rank(s))" if len(failed) > 1 else ""
        raise CheckpointError(f"{what}: rank {rank}{others}: {error}")
