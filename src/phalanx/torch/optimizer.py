"""``DistributedOptimizer``: averages gradients across ranks while ``backward()`` runs.

Per-parameter ``register_post_accumulate_grad_hook`` hooks mark gradients ready; full buckets (fusion
threshold ``HOROVOD_FUSION_THRESHOLD``, default 128 MiB) start an asynchronous allreduce at once, in a
fixed bucket order (see ``_buckets``); ``step()`` waits for them. The returned object is an instance of a
subclass of the wrapped optimizer's class (as in Horovod), so ``isinstance`` and ``state_dict`` work.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

import phalanx.timeline as timeline
from phalanx.env import settings
from phalanx.errors import CollectiveMismatchError, InvalidArgumentError, NotInitializedError
from phalanx.job import stats
from phalanx.torch import async_ops
from phalanx.torch._engine import join as _join
from phalanx.torch._engine import reduce as reduction
from phalanx.torch._setup import state as _state
from phalanx.torch._train import buckets as bucketing
from phalanx.torch._train import sparse as _sparse
from phalanx.torch._train.grad_trace import GradTrace
from phalanx.torch.compression import Compression, Compressor
from phalanx.torch.functions import allgather_object
from phalanx.torch.process_sets import ProcessSet, global_process_set, groups_of

DEFAULT_FUSION_THRESHOLD_BYTES = 128 * 1024 * 1024


MIN_AUTO_BUCKET_BYTES = 1024 * 1024
AUTO_BUCKETS = 4
INLINE_TAIL = 1  # last buckets run in the thread that waits for them (with a shm grad worker: no hand-over)


def fusion_threshold_bytes(total_bytes: int = 0, overlap: bool = True) -> int:
    """The largest gradient bucket, in bytes.

    ``HOROVOD_FUSION_THRESHOLD`` when set (0 means one bucket per parameter). Unset, the default maximum is
    128 MiB and, when ``overlap``, the gradients are split into about ``AUTO_BUCKETS`` buckets of at least
    1 MiB, so that the first buckets' allreduce overlaps the rest of the backward pass (what Horovod's
    cycle-time fusion achieves dynamically). Without overlap (buckets that travel through shared memory
    run in ``synchronize()``, after backward, unless ``PHALANX_SHM_GRAD_ASYNC=1``) every extra bucket only
    adds a round of latency, so they are fused up to the maximum.

    Args:
        total_bytes: the size of all gradients (for the default split).
        overlap: whether a bucket's allreduce can run while backward goes on.

    Raises:
        ValueError: the variable is not an integer.
    """
    threshold = settings.FUSION_THRESHOLD.get()
    if threshold is not None:
        return max(threshold, 1)
    if not overlap:
        return DEFAULT_FUSION_THRESHOLD_BYTES
    auto = max(MIN_AUTO_BUCKET_BYTES, -(-total_bytes // AUTO_BUCKETS))
    return min(DEFAULT_FUSION_THRESHOLD_BYTES, auto)


def _names(optimizer: torch.optim.Optimizer, named_parameters: Any) -> dict[int, str]:
    """Map id(param) -> name, validating Horovod's rules (no duplicates, every parameter named)."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    if named_parameters is None:  # Horovod's names: group index, then index in the group
        return {id(p): f"allreduce.noname.{i}.{j}" for i, group in enumerate(optimizer.param_groups)
                for j, p in enumerate(group["params"])}
    named = list(named_parameters)
    if named and not isinstance(named[0], tuple):
        raise InvalidArgumentError("named_parameters should be a sequence of (name, parameter) tuples, usually "
                         "model.named_parameters()")
    names = [n for n, _ in named]
    dups = sorted({n for n in names if names.count(n) > 1})
    if dups:
        raise InvalidArgumentError(f"parameter names in named_parameters must be unique; duplicates: {dups}")
    by_id = {id(p): n for n, p in named}
    missing = [i for i, p in enumerate(params) if id(p) not in by_id]
    if missing:
        raise InvalidArgumentError(
            f"named_parameters was given but {len(missing)} optimizer parameter(s) are not named "
            f"(indices {missing[:10]} of the optimizer's parameters); pass model.named_parameters() of the "
            "model the optimizer was built from"
        )
    return by_id


def _split(params: list[torch.Tensor], num_groups: int, groups: Any) -> list[list[torch.Tensor]] | None:
    if groups is not None:
        if not isinstance(groups, list) or not all(isinstance(g, list) for g in groups):
            raise InvalidArgumentError("groups must be a list of lists of parameters")
        grouped = {id(p) for g in groups for p in g}
        rest = [[p] for p in reversed(params) if id(p) not in grouped]
        return [list(g) for g in groups] + rest
    if num_groups > 0:
        ordered = list(reversed(params))
        per = -(-len(ordered) // num_groups)
        return [ordered[i : i + per] for i in range(0, len(ordered), per)]
    return None


class _DistributedOptimizer(torch.optim.Optimizer):
    """Methods grafted onto a subclass of the user's optimizer class (see :func:`DistributedOptimizer`)."""

    def __init__(self, params: Any, named_parameters: Any, compression: type[Compressor], backward_passes_per_step: int,
                 op: int, gradient_predivide_factor: float, num_groups: int, groups: Any, sparse_as_dense: bool,
                 process_set: ProcessSet) -> None:
        super(self.__class__, self).__init__(params)  # type: ignore[call-arg]
        self._phalanx_setup(named_parameters, compression, backward_passes_per_step, op,
                            gradient_predivide_factor, num_groups, groups, process_set)
        self.sparse_as_dense = sparse_as_dense
        self._sparse = _sparse.SparseGrads(self._ps, self._op)

    def _phalanx_setup(self, named_parameters: Any, compression: type[Compressor], bpps: int, op: int,
                       predivide: float, num_groups: int, groups: Any, ps: ProcessSet) -> None:
        if op not in (reduction.Average, reduction.Sum, reduction.Adasum):
            raise InvalidArgumentError(f"DistributedOptimizer op must be hvd.Average or hvd.Sum, got {op!r}")
        reduction.check_op(op, torch.float32)
        if predivide != 1.0 and op != reduction.Average:
            raise InvalidArgumentError("gradient_predivide_factor != 1.0 requires op=hvd.Average")
        if bpps < 1:
            raise InvalidArgumentError(f"backward_passes_per_step must be >= 1, got {bpps}")
        self._names = _names(self, named_parameters)
        self._trace = GradTrace(self._names)
        by_id = {id(p): p for g in self.param_groups for p in g["params"]}
        self._parameter_names = {by_id[k]: name for k, name in self._names.items()}  # Horovod's attribute
        self._compression, self._bpps, self._ps = compression, bpps, ps
        self._passes: dict[int, int] = {}
        self._op, self._predivide = op, predivide
        if not ps.included():  # as Horovod: a rank outside the set steps on its own gradients, no hooks
            self._buckets, self._next, self._hooks, self._early = [], 0, [], None
            self._passes.clear()
            self._synchronized, self._should_sync = False, True
            return
        self._phalanx_groups = groups_of(ps)
        n = len(self._phalanx_groups.ranks)
        self._rescale(n)
        params = [p for g in self.param_groups for p in g["params"] if p.requires_grad]
        total = sum(p.numel() * p.element_size() for p in params)
        # Buckets deferred to synchronize() (shared memory, unless PHALANX_SHM_GRAD_ASYNC) gain nothing by splitting.
        overlap = self._phalanx_groups.grad.overlaps() or not all(p.device.type == "cpu" for p in params)
        threshold = fusion_threshold_bytes(total, overlap)
        self._buckets = bucketing.plan(params, threshold, _split(params, num_groups, groups))
        self._where = {id(p): (b, i) for b in self._buckets for i, p in enumerate(b.params)}
        self._next = 0
        self._synchronized = False
        self._should_sync = True
        self._hooks = [p.register_post_accumulate_grad_hook(self._hook) for p in params] if n > 1 else []
        if n > 1:
            layout = [(b.buffer.numel(), b.buffer.dtype, b.buffer.device) for b in self._buckets]
            self._layout = _join.register_layout(ps.process_set_id or 0, layout, compression)
        self._early = None
        # Not in an elastic worker: a replacement builds its optimizer while the survivors are in sync(), and a
        # collective only it issues would not match theirs; early reduction (transport/_early.py) is off there too
        # (a re-formed world's ranks would claim anew).
        if n > 1 and settings.ELASTIC_WORKER_ID.get() is None:
            key = (ps.process_set_id or 0, self._layout)
            self._early = bucketing.early_area(self._buckets, compression, self._phalanx_groups.grad, key)
            self._check_layout()

    def _rescale(self, n: int) -> None:
        avg, predivide = self._op == reduction.Average, self._predivide
        self._n = n
        self._prescale = (1.0 / predivide if avg else 1.0) if predivide != 1.0 else (1.0 / n if avg else 1.0)
        self._postscale = predivide / n if avg and predivide != 1.0 else 1.0

    def _follow_world(self) -> None:
        """After an elastic job re-formed its world: average over the new size, and drop the bookkeeping of
        the step a failed collective left half done (its buckets' work belongs to the old group)."""
        try:
            groups = groups_of(self._ps)
        except (NotInitializedError, ValueError):
            return  # after hvd.shutdown(): nothing to follow (and no collective will run)
        if groups is self._phalanx_groups:
            return
        self._phalanx_groups = groups
        self._early = None
        self._rescale(len(groups.ranks))
        self._passes.clear()
        self._next = 0
        self._synchronized = False
        for bucket in self._buckets:
            bucket.reset()

    def _check_layout(self) -> None:
        mine = [(str(b.buffer.dtype), b.buffer.numel()) for b in self._buckets]
        seen = allgather_object(mine, name="DistributedOptimizer.layout", process_set=self._ps)
        if any(s != mine for s in seen):
            detail = "; ".join(f"rank {groups_of(self._ps).ranks[i]}: {s}" for i, s in enumerate(seen))
            raise CollectiveMismatchError(
                f"DistributedOptimizer gradient buckets (dtype, elements) differ between ranks: {detail}. "
                "Every rank must build the same model and optimizer (same parameters in the same order)"
            )

    def _hook(self, p: torch.Tensor) -> None:
        self._follow_world()
        key = id(p)
        count = self._passes.get(key, 0) + 1
        if count > self._bpps:
            raise InvalidArgumentError(
                "Gradients were computed more than backward_passes_per_step times before call to step(); "
                f"increase backward_passes_per_step (now {self._bpps}) to accumulate gradients locally"
            )
        self._passes[key] = count
        if count == self._bpps and p.grad is not None and p.grad.is_sparse:
            self._sparse.hooked(p, self._names[key], self.sparse_as_dense)
        if count == self._bpps:
            if timeline.current() is not None:  # off: one call per gradient and step
                self._trace.ready(key)
            bucket, i = self._where[key]
            bucket.pending.discard(key)
            early = self._early
            if early is not None and early.active():  # synchronize() launches the buckets after the early step
                if bucket is self._buckets[0]:
                    bucketing.mark_early(early, bucket, i, self._prescale)
            elif not bucket.pending:
                self._launch_ready()

    def _launch_ready(self, force: bool = False) -> None:
        while self._next < len(self._buckets):
            bucket = self._buckets[self._next]
            if bucket.pending and not force:
                return
            self._launch(bucket, force or self._next >= len(self._buckets) - INLINE_TAIL)
            self._next += 1

    def _launch(self, bucket: bucketing.Bucket, inline: bool) -> None:
        index, grad = self._next, groups_of(self._ps).grad
        tl = self._trace.launching(index, bucket.params)
        start = timeline.clock_ns() if tl is not None else 0
        if bucketing.launch_direct(bucket, self._compression, grad, self._prescale, inline):  # no copy to trace
            if tl is not None:  # (inline, the whole allreduce ran in the call)
                self._trace.begin(tl, index, bucket.params, timeline.ALLREDUCE, start)
            return
        if tl is not None:
            self._trace.begin(tl, index, bucket.params, timeline.MEMCPY_IN_FUSION_BUFFER)
        bucketing.pack(bucket, self._prescale)
        if tl is not None:
            self._trace.end(index, timeline.MEMCPY_IN_FUSION_BUFFER)
            self._trace.begin(tl, index, bucket.params, timeline.ALLREDUCE)
        bucketing.launch(bucket, self._compression, grad, inline)

    def _launch_early(self) -> None:
        """Agree with the peer on the first bucket's bytes reduced early; launch the rest of that bucket."""
        bucket = self._buckets[0]
        tl = self._trace.launching(0, bucket.params)
        start = timeline.clock_ns() if tl is not None else 0
        if bucketing.launch_early(bucket, self._early, groups_of(self._ps).grad, self._prescale):
            if tl is not None:  # the early reduction is part of the bucket's allreduce
                self._trace.begin(tl, 0, bucket.params, timeline.ALLREDUCE, start)
            self._next = 1

    def synchronize(self) -> None:
        """Wait for every gradient allreduce of this step (launching the ones whose hooks did not fire).

        Parameters without a gradient on this rank contribute zeros and receive the reduced gradient.
        """
        self._follow_world()
        if self._hooks:
            if self._early is not None and self._next == 0 and self._early.active():
                self._launch_early()
            self._launch_ready(force=True)
            announce = None
            if len(self._phalanx_groups.ranks) > 1:  # lets ranks that called hvd.join() serve this step
                announce = async_ops.optimizer_step_async(self._layout, self._ps)
            self._sparse.launch()
            waiting = stats.begin("allreduce")
            try:
                for i, bucket in enumerate(self._buckets):
                    bucketing.wait(bucket, self._compression, self._postscale)
                    self._trace.end(i, timeline.ALLREDUCE)
                    bucket.reset()
            except Exception as e:
                if announce is not None and not isinstance(e, CollectiveMismatchError):
                    _raise_mismatch(announce, e)
                raise
            if announce is not None:
                async_ops.synchronize(announce)
            self._sparse.finish()
            if waiting:
                stats.end("allreduce", waiting, self._bucket_bytes())
            self._next = 0
            if self._early is not None:
                self._early.release()
        self._passes.clear()
        self._synchronized = True

    @contextlib.contextmanager
    def skip_synchronize(self) -> Iterator[None]:
        """Within this context ``step()`` does not synchronize (call ``synchronize()`` yourself first)."""
        self._should_sync = False
        try:
            yield
        finally:
            self._should_sync = True

    def step(self, closure: Callable[[], float] | None = None) -> Any:
        """Synchronize gradients (unless already done or skipped), then run the wrapped optimizer's step.

        After ``synchronize()`` without ``skip_synchronize()``, warns as Horovod does (but, unlike Horovod, does
        not reduce the already reduced gradients a second time).
        """
        if self._should_sync and self._synchronized:
            warnings.warn(
                "optimizer.step() called without optimizer.skip_synchronize() context after "
                "optimizer.synchronize(); the gradients are not reduced again. Call step() inside "
                "`with optimizer.skip_synchronize():` after synchronize()",
                stacklevel=2,
            )
        if self._should_sync and not self._synchronized:
            self.synchronize()
        self._synchronized = False
        stats.step()
        return super(self.__class__, self).step(closure)

    def _bucket_bytes(self) -> int:
        """Bytes of every gradient bucket (what one step allreduces), for the stats records."""
        return sum(b.buffer.numel() * b.buffer.element_size() for b in self._buckets)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero gradients; refused while this step's allreduces are in flight (it would race them).

        Raises:
            ValueError: called after ``backward()`` but before ``step()``/``synchronize()``.
        """
        self._follow_world()
        if self._next > 0 or any(c == self._bpps for c in self._passes.values()):
            raise InvalidArgumentError(
                "optimizer.zero_grad() was called after loss.backward() but before optimizer.step() or "
                "optimizer.synchronize(); this would race the gradient allreduce"
            )
        self._passes.clear()
        for bucket in self._buckets:
            bucket.reset()
        super(self.__class__, self).zero_grad(set_to_none)


def _raise_mismatch(announce: Any, cause: Exception) -> None:
    """Raise the step announcement's ``CollectiveMismatchError``, if it has one, from a bucket's failure: a
    rank that issued another collective instead of this step fails on the mismatch and leaves, and its peers'
    buckets only see a peer that left; the mismatch says why."""
    try:
        if async_ops.poll(announce):  # never blocks: a peer that is stuck rather than gone is not waited for twice
            async_ops.synchronize(announce)
    except CollectiveMismatchError as mismatch:
        raise mismatch from cause
    except Exception:  # the announcement failed too (the same departed peer): the bucket's error stands
        return


def DistributedOptimizer(
    optimizer: torch.optim.Optimizer, named_parameters: Any = None,
    compression: type[Compressor] = Compression.none, backward_passes_per_step: int = 1, op: int = reduction.Average,
    gradient_predivide_factor: float = 1.0, num_groups: int = 0, groups: Sequence[Any] | None = None,
    sparse_as_dense: bool = False, process_set: ProcessSet = global_process_set,
) -> torch.optim.Optimizer:
    """Wrap ``optimizer`` so that ``step()`` applies gradients averaged over every rank.

    Args:
        optimizer: any ``torch.optim`` optimizer (its options are kept; its state starts empty).
        named_parameters: ``model.named_parameters()``; names must be unique and cover every parameter.
        compression: ``Compression.none`` or ``Compression.fp16`` for the gradient allreduce.
        backward_passes_per_step: backward passes accumulated locally before each allreduce.
        op: ``Average`` (default) or ``Sum``.
        gradient_predivide_factor: Average as ``sum(g / f) * f / size`` (numerics of low precision).
        num_groups: split the parameters into this many fused groups (0: fuse by threshold).
        groups: explicit list of lists of parameters, each reduced as one group.
        sparse_as_dense: reduce sparse gradients (``nn.Embedding(sparse=True)``) as dense tensors, then make
            them sparse again; False (default): allgather their indices and values (Horovod's sparse path).
        process_set: the ranks that average gradients.

    Returns:
        An optimizer of a subclass of ``type(optimizer)``.

    Raises:
        ValueError: duplicate or missing names, bad op or arguments; before ``hvd.init()``.
        NotImplementedError: ``op=Adasum``.
        CollectiveMismatchError: ranks built different parameter layouts.
    """
    _state.topology()
    cls = type(optimizer.__class__.__name__, (optimizer.__class__,), dict(_DistributedOptimizer.__dict__))
    return cls(optimizer.param_groups, named_parameters, compression, backward_passes_per_step, op,
               gradient_predivide_factor, num_groups, groups, sparse_as_dense, process_set)
