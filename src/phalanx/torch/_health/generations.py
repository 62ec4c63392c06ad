"""Generations of ``hvd.init()`` on one job store: ``init`` again after ``shutdown`` in the same process.

Under a launcher every ``hvd.init()`` of a rank is one *generation* (the first is 1). The launcher's store
outlives ``hvd.shutdown()``; each generation's process groups live under their own key prefix of it, so a
re-init never reads a previous group's addresses (gloo would connect to a closed port).

Every rank publishes its generation (``phalanx.gen/<rank>``) when it enters ``init``:

* a rank entering generation g waits until every rank has entered g (a peer still finishing its work of
  generation g-1 arrives later), up to ``HOROVOD_GLOO_TIMEOUT_SECONDS`` (unset: ``PHALANX_START_TIMEOUT_S``);
  the error names each missing rank's
  generation and, when it is blocked in a collective, that collective;
* a rank blocked in a collective whose peer has entered a later generation can never be served: the stall
  inspector asks :func:`moved_on` and raises at once, and the next ``hvd.init()`` rejoins (``RUNTIME.job.superseded``).
"""

from __future__ import annotations

import json
import time
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from phalanx.env import names as env_names
from phalanx.env import settings
from phalanx.errors import HorovodInternalError
from phalanx.torch._runtime import RUNTIME
from phalanx.transport import api as transport

PREFIX = "phalanx.gen/"
POLL_S = 0.005  # between two reads of the arrival count while peers are missing
POLL_MAX_S = 0.1
STALL_PREFIX = "phalanx.stall/"  # the stall inspector's records (``_stall``), read to describe a peer


def store_of(generation: int) -> Any:
    """The default store of ``generation``'s process group (the job store itself for the first)."""
    if generation <= 1:
        return RUNTIME.job.store
    return dist.PrefixStore(f"phalanx.init.{generation}/", RUNTIME.job.store)


def first(rank: int) -> None:
    """Record the first generation, created by ``env://`` rendezvous (call right after it)."""
    RUNTIME.job.store = dist.distributed_c10d._get_default_store()
    RUNTIME.job.generation, RUNTIME.job.rank, RUNTIME.job.superseded = 1, rank, None
    RUNTIME.job.store.set(f"{PREFIX}{rank}", "1")
    RUNTIME.job.store.add("phalanx.init.1/arrived", 1)


def rejoin(backend: str, rank: int, size: int, timeout: timedelta | None) -> None:
    """Create the default process group of the next generation once every rank has entered it.

    Args:
        backend: the process group's backend.
        rank, size: this rank and the number of ranks.
        timeout: ``HOROVOD_GLOO_TIMEOUT_SECONDS`` (the group's timeout, and how long to wait for the other
            ranks), or None: torch's group timeout, and ``PHALANX_START_TIMEOUT_S`` for the wait.

    Raises:
        HorovodInternalError: some rank did not call ``hvd.init()`` in time.
    """
    gen = RUNTIME.job.generation + 1
    RUNTIME.job.store.set(f"{PREFIX}{rank}", str(gen))
    RUNTIME.job.store.add(f"phalanx.init.{gen}/arrived", 1)
    _await_peers(gen, rank, size, timeout.total_seconds() if timeout is not None else start_timeout_s())
    transport.init_process_group(backend, store=store_of(gen), rank=rank, world_size=size, timeout=timeout)
    RUNTIME.job.generation, RUNTIME.job.rank, RUNTIME.job.superseded = gen, rank, None


def _await_peers(gen: int, rank: int, size: int, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    pause = POLL_S
    while RUNTIME.job.store.add(f"phalanx.init.{gen}/arrived", 0) < size:
        if time.monotonic() > deadline:
            raise HorovodInternalError(_missing(gen, rank, size, timeout_s))
        time.sleep(pause)
        pause = min(pause * 2, POLL_MAX_S)


def generation_of(rank: int) -> int:
    """The generation ``rank`` last entered (0: it never called ``hvd.init()`` under this store)."""
    key = f"{PREFIX}{rank}"
    if not RUNTIME.job.store.check([key]):
        return 0
    return int(RUNTIME.job.store.get(key).decode() or 0)


def position(rank: int) -> str:
    """Where ``rank`` is, for error messages: its generation and, when it is blocked, its collective."""
    gen = generation_of(rank)
    where = f"rank {rank} is in hvd.init() #{gen}" if gen else f"rank {rank} never called hvd.init()"
    if gen:
        store = dist.PrefixStore(STALL_PREFIX, store_of(gen))
        key = f"rec/{rank}"
        text = store.get(key).decode() if store.check([key]) else ""
        wait = json.loads(text).get("wait") if text else None
        if wait:
            name = wait.get("name") or "<unnamed>"
            where += f", blocked in {wait['kind']} of tensor {name!r} (its collective #{wait['seq']} there)"
    return where


def _missing(gen: int, rank: int, size: int, timeout_s: float) -> str:
    late = [r for r in range(size) if r != rank and generation_of(r) < gen]
    where = "; ".join(position(r) for r in late)
    return (
        f"rank {rank} waited {timeout_s:g} s in hvd.init() #{gen} for rank(s) {late} to call hvd.init() "
        f"again after hvd.shutdown(): {where}. Every rank must call hvd.shutdown() and hvd.init() the same "
        f"number of times; raise {env_names.HOROVOD_GLOO_TIMEOUT_SECONDS} (or, unset, "
        f"{env_names.PHALANX_START_TIMEOUT_S}) if a rank legitimately takes longer"
    )


def moved_on(ranks: tuple[int, ...]) -> str | None:
    """Why a collective among ``ranks`` of this generation can never complete (a member entered a later
    generation: it called ``hvd.shutdown()`` and ``hvd.init()``), else None."""
    job = RUNTIME.job
    if job.store is None:
        return None
    gone = [(r, g) for r in ranks if r != job.rank and (g := generation_of(r)) > job.generation]
    if not gone:
        return None
    where = ", ".join(f"rank {r} is in hvd.init() #{g}" for r, g in gone)
    job.superseded = (
        f"rank(s) {[r for r, _ in gone]} left hvd.init() #{job.generation} of rank {job.rank} ({where}: they "
        "called hvd.shutdown() and hvd.init() again); its collectives can never complete. Call "
        "hvd.shutdown() and hvd.init() to rejoin them"
    )
    return job.superseded


def start_timeout_s() -> float:
    """``PHALANX_START_TIMEOUT_S``: how long ``hvd.init()`` waits for every rank (seconds).

    Raises:
        InvalidArgumentError: the value is not a positive number.
    """
    return settings.START_TIMEOUT.get()

