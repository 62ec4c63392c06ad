"""``init`` for TensorFlow processes: phalanx.torch's ``init`` plus TensorFlow's thread pools sized like torch's."""

from __future__ import annotations

import os
from collections.abc import Sequence

import tensorflow as tf

import phalanx.torch as ptorch
from phalanx.env import names as env_names
from phalanx.torch.process_sets import ProcessSet


def init(comm: object = None, process_sets: Sequence[ProcessSet] | None = None) -> None:
    """Initialize phalanx for TensorFlow (idempotent; the same state as ``phalanx.torch.init``).

    When ``OMP_NUM_THREADS`` is not set and several ranks share a host, TensorFlow's intra-op pool gets
    ``cpu_count // local_size`` threads (only possible before TensorFlow runs its first op; later calls leave
    it as it is), so ranks do not oversubscribe the host's cores. The inter-op pool is left wide: each
    collective waiting inside a TensorFlow 1-style graph holds one of its threads (``_pools``).

    Args:
        comm: an MPI communicator in Horovod; only ``None`` is supported.
        process_sets: static process sets to register (every rank passes the same list).

    Raises:
        ValueError: ``comm`` was given, or the launcher's variables are malformed.
    """
    ptorch.init(comm=comm, process_sets=process_sets)
    local = ptorch.local_size()
    if os.environ.get(env_names.OMP_NUM_THREADS) or local <= 1:
        return
    share = max(1, (os.cpu_count() or 1) // local)
    try:
        tf.config.threading.set_intra_op_parallelism_threads(share)
    except RuntimeError:
        pass  # TensorFlow's runtime is already initialized: its pools cannot change any more
