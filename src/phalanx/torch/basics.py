"""``init``/``shutdown``, topology queries and capability queries (Horovod's ``horovod.torch`` basics)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

import phalanx.timeline as timeline
from phalanx.errors import InvalidArgumentError
from phalanx.torch._engine import background as _background
from phalanx.torch._engine import core as _engine
from phalanx.torch._runtime import RUNTIME
from phalanx.torch._setup import log as _log
from phalanx.torch._setup import malloc as _malloc
from phalanx.torch._setup import membership as _membership
from phalanx.torch._setup import observe as _observe
from phalanx.torch._setup import state as _state
from phalanx.torch.process_sets import ProcessSet, clear_process_sets


def init(comm: Any = None, process_sets: Sequence[ProcessSet] | str | None = None) -> None:
    """Initialize phalanx.torch (idempotent; collective when it creates process sets).

    Works under phalanx launchers and ``torchrun`` (``env://``), inside an already initialized
    ``torch.distributed`` job, and with no launcher at all (one rank). After :func:`shutdown`, ``init``
    joins the job again (every rank must call both the same number of times; see ``_health.generations``).

    Args:
        comm: an MPI communicator in Horovod; only ``None`` is supported.
        process_sets: static process sets to register (every rank passes the same list), or ``"dynamic"``
            to allow :func:`add_process_set` / :func:`remove_process_set` after init (as
            ``HOROVOD_DYNAMIC_PROCESS_SETS=1`` does).

    Raises:
        ValueError: ``comm`` was given, ``process_sets`` is another string, or the launcher's variables are
            malformed.
        HorovodInternalError: a re-init did not meet every rank within ``PHALANX_START_TIMEOUT_S``.
    """
    if comm is not None:
        raise InvalidArgumentError(
            "hvd.init(comm=...) (MPI communicators) is not supported by phalanx; call hvd.init()")
    if isinstance(process_sets, str) and process_sets != "dynamic":
        raise InvalidArgumentError(f"hvd.init(process_sets={process_sets!r}): pass a list of ProcessSet or 'dynamic'")
    if RUNTIME.process.topology is not None:
        if RUNTIME.job.superseded is None:
            return
        shutdown()  # a peer has moved on to a new hvd.init(): rejoin it (see _health.generations)
    _log.configure()  # HOROVOD_LOG_LEVEL / HOROVOD_LOG_HIDE_TIME (phalanxrun --log-level ...)
    _state.join_process_group()
    _malloc.tune()  # large tensors reuse heap memory instead of fresh page-faulted mmaps (PHALANX_MALLOC_TUNE)
    try:
        _background.prepare()
        _engine.start_inspector()  # every rank clears its stall record before the first collective
        static = None if isinstance(process_sets, str) else process_sets
        _membership.init_process_sets(static, dynamic=process_sets == "dynamic")
        timeline.start_from_env()
        _observe.report_stats()
    except BaseException:
        shutdown()
        raise


def shutdown() -> None:
    """Forget process sets and pending collectives and leave the process group ``init`` created.

    phalanx.torch's one reset path: release what the last ``init`` holds (pending collectives, the process
    sets' groups, the process group, the timeline), then ``RUNTIME.reset()`` forgets its state (``_runtime``).
    """
    _engine.reset()
    clear_process_sets()
    _state.leave_process_group()
    timeline.stop_timeline()
    RUNTIME.reset()


def start_timeline(file_path: str, mark_cycles: bool = False) -> None:
    """Start recording collectives to a Chrome trace at ``file_path`` (Horovod's ``hvd.start_timeline``).

    Raises:
        TimelineError: the file cannot be written.
    """
    timeline.start_timeline(file_path, mark_cycles=mark_cycles)


def stop_timeline() -> None:
    """Stop the timeline started by :func:`start_timeline` or ``HOROVOD_TIMELINE``."""
    timeline.stop_timeline()


def is_initialized() -> bool:
    """Whether :func:`init` has been called (and :func:`shutdown` not since)."""
    return RUNTIME.process.topology is not None


def size() -> int:
    """Number of ranks in the job. Raises ValueError before ``hvd.init()``."""
    return _state.topology().size


def rank() -> int:
    """This process's global rank. Raises ValueError before ``hvd.init()``."""
    return _state.topology().rank


def local_size() -> int:
    """Number of ranks on this host. Raises ValueError before ``hvd.init()``."""
    return _state.topology().local_size


def local_rank() -> int:
    """This process's rank among the ranks on its host. Raises ValueError before ``hvd.init()``."""
    return _state.topology().local_rank


def cross_size() -> int:
    """Number of ranks with this rank's local rank (hosts, when hosts are uniform)."""
    return _state.topology().cross_size


def cross_rank() -> int:
    """This rank's index among the ranks with the same local rank (its host's index, usually)."""
    return _state.topology().cross_rank


def is_homogeneous() -> bool:
    """Whether every host runs the same number of ranks."""
    topo = _state.topology()
    return topo.local_size * topo.cross_size == topo.size


def mpi_threads_supported() -> bool:
    """False: phalanx does not use MPI."""
    return False


def mpi_built() -> bool:
    """False: phalanx does not use MPI."""
    return False


def mpi_enabled() -> bool:
    """False: phalanx does not use MPI."""
    return False


def gloo_built() -> bool:
    """Whether torch.distributed has the gloo backend."""
    return bool(dist.is_gloo_available())


def gloo_enabled() -> bool:
    """Whether collectives on CPU tensors use gloo (always, when it is built)."""
    return gloo_built()


def nccl_built() -> bool:
    """Whether torch.distributed has NCCL (used for CUDA tensors)."""
    return bool(dist.is_nccl_available())


def ddl_built() -> bool:
    """False: IBM DDL is not supported."""
    return False


def ccl_built() -> bool:
    """False: oneCCL is not supported."""
    return False


def cuda_built() -> bool:
    """Whether torch was built with CUDA."""
    return torch.backends.cuda.is_built()


def rocm_built() -> bool:
    """Whether torch was built with ROCm."""
    return torch.version.hip is not None
