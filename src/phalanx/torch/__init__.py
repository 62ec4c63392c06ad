"""The Horovod API for PyTorch on ``torch.distributed``: ``import phalanx.torch as hvd``.

Gloo carries CPU tensors, NCCL CUDA tensors. Collectives run in the order each rank issues them (as in
``torch.distributed``); ranks that disagree on a collective get a ``RuntimeError`` on every rank. See
``docs/torch.md``.

Module map (public modules are Horovod's; the ``_*`` subpackages are private to this package):

- Horovod's API: ``basics`` (``init``, ``shutdown``, topology), ``mpi_ops`` (the collectives),
  ``async_ops`` (``*_async``, ``poll``, ``synchronize``, ``join``, ``barrier``), ``functions``
  (``broadcast_parameters``...), ``optimizer`` (``DistributedOptimizer``), ``compression``,
  ``process_sets``, ``sync_batch_norm``, ``checkpoint``, ``elastic/`` (``hvd.elastic``); ``frontend``: what
  ``phalanx.tensorflow`` builds on (op codes, process-set membership).
- ``_engine/``, one order of collectives per rank: ``core`` (handles, queue, waits), ``rounds`` (one
  negotiated round, the same on every member), ``collective`` / ``collectives`` (each kind's local side),
  ``header`` (the control block's wire format), ``names`` (matching by name), ``speculate`` (payloads sent
  ahead of the check), ``background`` (the thread running ``*_async`` jobs), ``join``, ``reduce`` (op codes
  and local reduction), ``trace`` (timeline events).
- ``_health/``: ``stall`` (the stall inspector), ``deadlock`` (its analysis), ``hang`` (the hang report),
  ``generations`` (``init`` again after ``shutdown`` on one job store).
- ``_setup/``, a rank's process set-up: ``state`` (the process group, this rank's ``RankIdentity``),
  ``membership`` (registering process sets), ``log``, ``malloc``, ``observe``.
- ``_train/``, the training side's helpers: ``buckets``, ``sparse`` and ``grad_trace`` (the optimizer's: its
  gradients' timeline rows, one per tensor), ``autograd`` (the collectives' autograd Functions), ``durable``
  (checkpoint files written whole).
- ``_runtime``: all of the package's mutable state, ``RUNTIME`` (below).

Process-wide state, and its one reset path: every piece of state is a field of ``_runtime.RUNTIME`` (the
topology, the engine, the process-set registry, the ``*_async`` runner, the stall inspector and hang watcher,
the job's generations, an elastic round); the modules hold none. ``hvd.shutdown()`` (``basics.shutdown``)
releases what the last ``init`` holds, then ``RUNTIME.reset()`` replaces its per-init fields, so ``hvd.init()``
starts afresh; the process-lifetime fields, and why each is kept, are listed in ``_runtime``'s docstring.
tests/unit/torch/test_torch_reset.py checks that nothing of one ``init`` survives its ``shutdown`` and that
no module holds a state object of its own.
"""

from __future__ import annotations

from phalanx.errors import HorovodInternalError
from phalanx.torch import elastic
from phalanx.torch._engine.reduce import Adasum, Average, Max, Min, Product, Sum
from phalanx.torch._setup.membership import add_process_set, remove_process_set
from phalanx.torch.async_ops import (
    allgather_async,
    allreduce_async,
    allreduce_async_,
    alltoall_async,
    barrier,
    broadcast_async,
    broadcast_async_,
    grouped_allgather_async,
    grouped_allreduce_async,
    grouped_allreduce_async_,
    grouped_reducescatter_async,
    join,
    poll,
    reducescatter_async,
    synchronize,
)
from phalanx.torch.basics import (
    ccl_built,
    cross_rank,
    cross_size,
    cuda_built,
    ddl_built,
    gloo_built,
    gloo_enabled,
    init,
    is_homogeneous,
    is_initialized,
    local_rank,
    local_size,
    mpi_built,
    mpi_enabled,
    mpi_threads_supported,
    nccl_built,
    rank,
    rocm_built,
    shutdown,
    size,
    start_timeline,
    stop_timeline,
)
from phalanx.torch.compression import Compression
from phalanx.torch.functions import (
    allgather_object,
    broadcast_object,
    broadcast_optimizer_state,
    broadcast_parameters,
)
from phalanx.torch.mpi_ops import (
    allgather,
    allreduce,
    allreduce_,
    alltoall,
    broadcast,
    broadcast_,
    grouped_allgather,
    grouped_allreduce,
    grouped_allreduce_,
    grouped_reducescatter,
    reducescatter,
    sparse_allreduce_async,
)
from phalanx.torch.optimizer import DistributedOptimizer
from phalanx.torch.process_sets import ProcessSet, global_process_set
from phalanx.torch.sync_batch_norm import SyncBatchNorm

__all__ = [
    "Adasum", "Average", "Compression", "DistributedOptimizer", "HorovodInternalError", "Max", "Min",
    "ProcessSet", "Product", "Sum", "SyncBatchNorm", "add_process_set", "allgather", "allgather_async",
    "allgather_object", "allreduce",
    "allreduce_", "allreduce_async", "allreduce_async_", "alltoall", "alltoall_async", "barrier", "broadcast",
    "broadcast_", "broadcast_async", "broadcast_async_", "broadcast_object", "broadcast_optimizer_state",
    "broadcast_parameters", "ccl_built", "cross_rank", "cross_size", "cuda_built", "ddl_built",
    "elastic", "global_process_set", "gloo_built", "gloo_enabled", "grouped_allgather", "grouped_allgather_async",
    "grouped_allreduce", "grouped_allreduce_", "grouped_allreduce_async", "grouped_allreduce_async_",
    "grouped_reducescatter", "grouped_reducescatter_async", "init", "is_homogeneous", "is_initialized", "join",
    "local_rank", "local_size", "mpi_built", "mpi_enabled", "mpi_threads_supported", "nccl_built", "poll",
    "rank", "reducescatter", "reducescatter_async", "remove_process_set", "rocm_built", "shutdown", "size",
    "sparse_allreduce_async", "start_timeline", "stop_timeline", "synchronize",
]
