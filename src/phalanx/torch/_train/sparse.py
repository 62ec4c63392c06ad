"""Sparse gradients in the ``DistributedOptimizer`` (``nn.Embedding(sparse=True)``), Horovod's two ways.

* ``sparse_as_dense=True``: the hook makes the gradient dense, it is reduced in its bucket like any other,
  and ``synchronize`` makes the result sparse again (the wrapped optimizer, e.g. ``SparseAdam``, gets a
  sparse gradient as without phalanx).
* ``sparse_as_dense=False`` (Horovod's default): the hook takes the sparse gradient out of the bucket (its
  slot carries zeros), ``synchronize`` allgathers its indices and values (``sparse_allreduce_async``) and
  hands the sparse result back.

Every rank of a model produces sparse gradients for the same parameters, so the allgathers are issued in
the same order (the optimizer's parameter order) on every rank.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from phalanx.torch import async_ops
from phalanx.torch.mpi_ops import sparse_allreduce_async
from phalanx.torch.process_sets import ProcessSet


class SparseGrads:
    """One optimizer's sparse gradients of the current step."""

    def __init__(self, process_set: ProcessSet, op: int) -> None:
        self.ps, self.op = process_set, op
        self.dense: list[torch.Tensor] = []  # parameters whose gradient was made dense (sparse_as_dense)
        self.gathered: dict[int, tuple[torch.Tensor, str, torch.Tensor]] = {}  # id -> (param, name, grad)
        self.waits: list[tuple[torch.Tensor, Callable[[], torch.Tensor]]] = []

    def hooked(self, p: torch.Tensor, name: str, as_dense: bool) -> None:
        """``p``'s sparse gradient is final for this step: route it (see the module)."""
        assert p.grad is not None
        if as_dense:
            p.grad = p.grad.to_dense()
            self.dense.append(p)
        else:
            self.gathered[id(p)] = (p, name, p.grad)
            p.grad = None  # its bucket slot carries zeros

    @async_ops.runs_inline
    def launch(self) -> None:
        """Start the allgathers of the sparse path (in the order the parameters were hooked)."""
        for p, name, grad in self.gathered.values():
            self.waits.append((p, sparse_allreduce_async(grad, name, self.op, self.ps)))
        self.gathered.clear()

    def finish(self) -> None:
        """Give every sparse parameter its reduced, sparse gradient."""
        for p, wait in self.waits:
            p.grad = wait()
        for p in self.dense:
            assert p.grad is not None
            p.grad = p.grad.to_sparse()
        self.waits.clear()
        self.dense.clear()
