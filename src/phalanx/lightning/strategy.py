"""``HorovodStrategy``: a Lightning ``ParallelStrategy`` whose ranks, gradients and collectives are phalanx.torch's.

The methods live in :class:`HorovodMixin`; :func:`strategy_class` puts them on top of one flavour's
``ParallelStrategy`` (``lightning.pytorch`` and ``pytorch_lightning`` have separate class trees, and a
Trainer accepts only its own). As Lightning 1.x's ``HorovodStrategy``:

* ranks, world size and device come from ``hvd`` (a GPU job uses the GPU of ``hvd.local_rank()``);
* when fitting, the learning rates (and schedulers' base rates) are multiplied by ``hvd.size()``, the
  optimizers are wrapped in ``hvd.DistributedOptimizer`` with ``backward_passes_per_step`` =
  ``accumulate_grad_batches``, and rank 0's parameters and optimizer state are broadcast;
* the optimizers stay in ``skip_synchronize()``: the strategy synchronizes right after the backward pass
  that precedes a step, so gradient clipping sees the averaged gradients;
* ``reduce`` / ``all_gather`` / ``broadcast`` / ``barrier`` are hvd collectives (``self.log(sync_dist=True)``
  and the callbacks' decisions go through them); checkpoints are written by rank 0 only.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.util
from collections.abc import Callable, Iterable
from typing import Any

import torch

import phalanx.torch as hvd
from phalanx.errors import InvalidArgumentError
from phalanx.lightning.flavours import FLAVOURS, STRATEGY_NAME, check_flavour

# Lightning's reduce ops (strings, or torch.distributed.ReduceOp members by name) -> hvd ops.
_OPS = {"mean": hvd.Average, "avg": hvd.Average, "sum": hvd.Sum, "max": hvd.Max, "min": hvd.Min,
        "product": hvd.Product, "prod": hvd.Product}


def hvd_op(reduce_op: Any) -> int:
    """The hvd op for a Lightning ``reduce_op`` (``None``/"mean"/"avg", "sum", "max", "min", "product", or a
    ``torch.distributed.ReduceOp``).

    Raises:
        InvalidArgumentError: any other op.
    """
    if reduce_op is None:
        return int(hvd.Average)
    name = reduce_op if isinstance(reduce_op, str) else str(getattr(reduce_op, "name", reduce_op))
    op = _OPS.get(name.rsplit(".", 1)[-1].lower())
    if op is None:
        raise InvalidArgumentError(f"HorovodStrategy.reduce: unsupported reduce_op {reduce_op!r}; "
                                   f"use one of {', '.join(_OPS)}")
    return int(op)


def root_device_of(parallel_devices: list[torch.device] | None, local_rank: int) -> torch.device:
    """The device of a rank: ``cuda:<local_rank>`` when the Trainer chose GPUs (Horovod's one GPU per local
    rank, whatever ``devices`` said), else the CPU."""
    if parallel_devices and parallel_devices[0].type == "cuda":
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def _unwrap(optimizer: Any) -> Any:
    return getattr(optimizer, "_optimizer", optimizer)  # a LightningOptimizer holds the real one there


def scale_learning_rates(optimizers: Iterable[Any], lr_scheduler_configs: Iterable[Any], factor: int) -> None:
    """Multiply every param group's ``lr``, and every scheduler's ``base_lrs``, by ``factor`` (Horovod's rule:
    the learning rate grows with the number of ranks, as the effective batch does)."""
    for optimizer in optimizers:
        for group in optimizer.param_groups:
            group["lr"] *= factor
    for config in lr_scheduler_configs:
        scheduler = config.scheduler
        if hasattr(scheduler, "base_lrs"):
            scheduler.base_lrs = [lr * factor for lr in scheduler.base_lrs]


def _named_parameters(module: torch.nn.Module, optimizer: Any) -> list[tuple[str, torch.nn.Parameter]]:
    own = {id(p) for group in optimizer.param_groups for p in group["params"]}
    return [(name, p) for name, p in module.named_parameters() if id(p) in own]


class HorovodMixin:
    """The Horovod behaviour of ``HorovodStrategy`` (combined with a flavour's ``ParallelStrategy``)."""

    strategy_name = STRATEGY_NAME
    _flavour: str  # set by strategy_class
    _base_strategy: Any  # the flavour's Strategy class (teardown skips ParallelStrategy's cluster teardown)

    def __init__(self, accelerator: Any = None, parallel_devices: list[torch.device] | None = None,
                 checkpoint_io: Any = None, precision_plugin: Any = None) -> None:
        super().__init__(accelerator=accelerator, parallel_devices=parallel_devices,  # type: ignore[call-arg]
                         cluster_environment=None, checkpoint_io=checkpoint_io,
                         precision_plugin=precision_plugin)
        self._skips = contextlib.ExitStack()

    @staticmethod
    def _hvd() -> Any:
        hvd.init()  # idempotent; Lightning asks for ranks before setup (in Trainer.__init__)
        return hvd

    @property
    def global_rank(self) -> int:
        return int(self._hvd().rank())

    @property
    def local_rank(self) -> int:
        return int(self._hvd().local_rank())

    @property
    def node_rank(self) -> int:
        return int(self._hvd().cross_rank())

    @property
    def world_size(self) -> int:
        return int(self._hvd().size())

    @property
    def is_global_zero(self) -> bool:
        return self.global_rank == 0

    @property
    def is_distributed(self) -> bool:
        """True: Lightning then injects a ``DistributedSampler`` (with :attr:`distributed_sampler_kwargs`)."""
        return True

    @property
    def root_device(self) -> torch.device:
        return root_device_of(self.parallel_devices, self.local_rank)  # type: ignore[attr-defined]

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return {"num_replicas": self.world_size, "rank": self.global_rank}

    def setup_environment(self) -> None:
        """``hvd.init()``, then Lightning's rank-zero-only helpers learn this rank."""
        self._hvd()
        rank_zero = importlib.import_module(f"{self._flavour}.utilities.rank_zero")
        utils = importlib.import_module("lightning_utilities.core.rank_zero")
        rank_zero.rank_zero_only.rank = utils.rank_zero_only.rank = self.global_rank
        super().setup_environment()  # type: ignore[misc]

    def model_to_device(self) -> None:
        device = self.root_device
        if device.type == "cuda":
            torch.cuda.set_device(device)
        self.model.to(device)  # type: ignore[attr-defined]

    def setup(self, trainer: Any) -> None:
        super().setup(trainer)  # type: ignore[misc]
        if str(getattr(trainer.state.fn, "value", trainer.state.fn)) != "fit":
            return
        self._refuse_changing_accumulation(trainer)
        optimizers = [_unwrap(o) for o in self.optimizers]  # type: ignore[has-type]
        scale_learning_rates(optimizers, self.lr_scheduler_configs, self.world_size)  # type: ignore[attr-defined]
        wrapped = [self._distributed(o, int(trainer.accumulate_grad_batches)) for o in optimizers]
        hvd.broadcast_parameters(self.lightning_module.state_dict(), root_rank=0)  # type: ignore[attr-defined]
        for optimizer in wrapped:
            hvd.broadcast_optimizer_state(optimizer, root_rank=0)
            # Steps never synchronize: optimizer_step does, after the backward pass and before clipping.
            self._skips.enter_context(optimizer.skip_synchronize())
        self.optimizers = wrapped

    def _refuse_changing_accumulation(self, trainer: Any) -> None:
        scheduler = importlib.import_module(f"{self._flavour}.callbacks").GradientAccumulationScheduler
        if any(isinstance(c, scheduler) for c in trainer.callbacks):
            raise InvalidArgumentError(
                "HorovodStrategy: GradientAccumulationScheduler is not supported (the DistributedOptimizer's "
                "backward_passes_per_step is fixed when it is built); use Trainer(accumulate_grad_batches=N)"
            )

    def _distributed(self, optimizer: Any, accumulate: int) -> Any:
        if hasattr(optimizer, "skip_synchronize"):
            return optimizer  # already an hvd.DistributedOptimizer (built in configure_optimizers)
        named = _named_parameters(self.lightning_module, optimizer)  # type: ignore[attr-defined]
        return hvd.DistributedOptimizer(optimizer, named_parameters=named, backward_passes_per_step=accumulate)

    def optimizer_step(self, optimizer: Any, closure: Callable[[], Any], model: Any = None, **kwargs: Any) -> Any:
        """Step with a closure that synchronizes the gradients right after it ran (Lightning clips them
        after the closure, then steps)."""
        raw = _unwrap(optimizer)
        synchronize = getattr(raw, "synchronize", None)
        synced = closure if synchronize is None else functools.partial(_then, closure, synchronize)
        return super().optimizer_step(optimizer, synced, model, **kwargs)  # type: ignore[misc]

    def reduce(self, tensor: Any, group: Any = None, reduce_op: Any = "mean") -> Any:
        """Allreduce ``tensor`` over every rank (``"mean"`` by default); anything but a tensor is returned as is.

        Raises:
            InvalidArgumentError: a ``group`` (hvd has no torch process groups) or an unsupported op.
        """
        if not isinstance(tensor, torch.Tensor):
            return tensor
        _no_group(group, "reduce")
        return hvd.allreduce(tensor, op=hvd_op(reduce_op), name="HorovodStrategy.reduce")

    def all_gather(self, tensor: torch.Tensor, group: Any = None, sync_grads: bool = False) -> torch.Tensor:
        """Every rank's ``tensor`` stacked along a new first dimension of size ``world_size`` (Lightning 2.x's
        contract; same shape on every rank). Gradients flow back only with ``sync_grads=True``."""
        _no_group(group, "all_gather")
        with contextlib.nullcontext() if sync_grads else torch.no_grad():
            return hvd.allgather(tensor.unsqueeze(0), name="HorovodStrategy.all_gather")

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        return hvd.broadcast_object(obj, root_rank=src, name="HorovodStrategy.broadcast")

    def barrier(self, name: str | None = None) -> None:
        del name
        hvd.barrier()

    def teardown(self) -> None:
        """Leave ``skip_synchronize``; no collective here (a failed rank tears down alone)."""
        self._skips.close()
        self._base_strategy.teardown(self)


def _then(closure: Callable[[], Any], synchronize: Callable[[], None]) -> Any:
    result = closure()
    synchronize()
    return result


def _no_group(group: Any, what: str) -> None:
    if group is None:
        return
    world = getattr(importlib.import_module("torch.distributed"), "group", None)
    if group is getattr(world, "WORLD", object()):
        return
    raise InvalidArgumentError(f"HorovodStrategy.{what}: process group {group!r} is not supported; "
                               "leave group unset (every rank takes part)")


@functools.cache
def _build(flavour: str) -> type:
    strategies = importlib.import_module(f"{flavour}.strategies")
    attrs = {"__module__": __name__, "__doc__": HorovodMixin.__doc__, "_flavour": flavour,
             "_base_strategy": strategies.Strategy}
    return type("HorovodStrategy", (HorovodMixin, strategies.ParallelStrategy), attrs)


def strategy_class(flavour: str | None = None) -> type:
    """``HorovodStrategy`` for ``flavour`` (``None``: ``lightning.pytorch`` if installed, else
    ``pytorch_lightning``); the same class on every call.

    Raises:
        InvalidArgumentError: unknown flavour.
        ModuleNotFoundError: the flavour (or, for ``None``, either) is not installed.
    """
    if flavour is None:
        flavour = next((f for f in FLAVOURS if importlib.util.find_spec(f.partition(".")[0]) is not None), None)
        if flavour is None:
            raise ModuleNotFoundError("HorovodStrategy needs Lightning: pip install lightning (or pytorch_lightning)")
    return _build(check_flavour(flavour))
