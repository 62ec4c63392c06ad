"""Horovod's Keras callbacks (``hvd.callbacks``), for the Keras ``tf.keras`` is (Keras 3 or ``tf_keras``)."""

from __future__ import annotations

import importlib
import warnings
from collections.abc import Callable, Hashable, Iterable
from typing import Any

import numpy as np

import phalanx.torch as ptorch
from phalanx.errors import InvalidArgumentError
from phalanx.tensorflow import _bridge, keras_flavour, ops
from phalanx.tensorflow.tf_types import KerasModelLike, VariableLike
from phalanx.torch import frontend

keras: Any = keras_flavour.keras()
io_utils = importlib.import_module(f"{keras.__name__}.src.utils.io_utils")  # Keras' own console output


def model_variables(model: KerasModelLike) -> list[VariableLike]:
    """The model's variables and, when it has one, its optimizer's (Horovod's broadcast set)."""
    variables = list(model.variables)
    optimizer = getattr(model, "optimizer", None)
    if optimizer is not None:
        variables.extend(keras_flavour.optimizer_variables(optimizer))
    return variables


class BroadcastGlobalVariablesCallback(keras.callbacks.Callback):
    """Broadcast the model's and optimizer's variables from ``root_rank`` at the end of the first batch.

    Keras 3 builds optimizers (and subclassed models) lazily, during the first step, so the variables
    exist only then; as in Horovod, the broadcast happens after that first batch (its update used averaged
    gradients on every rank, and the broadcast then makes every rank's weights the root's).

    Args:
        root_rank: the global rank whose variables win.
        device: accepted for Horovod compatibility.
        local_variables: variables to leave as they are on each rank (e.g. the local layers' weights of a
            ``PartialDistributedOptimizer``).
    """

    def __init__(self, root_rank: int, device: str = "", local_variables: Iterable[object] | None = None) -> None:
        super().__init__()
        self.root_rank = root_rank
        self.local_variables = {_key(v) for v in (local_variables or [])}
        self.broadcast_done = False

    def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
        """Broadcast once, after the first batch."""
        if self.broadcast_done:
            return
        shared = [v for v in model_variables(self.model) if _key(v) not in self.local_variables]
        ops.broadcast_variables(shared, self.root_rank, name="BroadcastGlobalVariables")
        self.broadcast_done = True


def _key(variable: object) -> Hashable:
    return variable.ref() if hasattr(variable, "ref") else id(variable)


class BestModelCheckpoint(keras.callbacks.ModelCheckpoint):
    """Keep the model with the best value of ``monitor`` (Horovod's ``BestModelCheckpoint``), on rank 0.

    Horovod's Spark estimators set ``filepath`` themselves; used directly, pass ``filepath`` (a ``.keras``
    file) or set the attribute before ``fit``.

    Args:
        monitor: the metric to compare (``val_loss`` by default).
        verbose: 1 prints a line on each save.
        mode: ``auto``, ``min`` or ``max``.
        save_freq: ``epoch`` or a number of batches.
        filepath: where the best model goes (a ``.keras`` file).

    Raises:
        InvalidArgumentError: at the start of training, when no ``filepath`` was given.
    """

    def __init__(self, monitor: str = "val_loss", verbose: int = 0, mode: str = "auto",
                 save_freq: str | int = "epoch", filepath: str | None = None) -> None:
        super().__init__(filepath or "best.keras", monitor=monitor, verbose=verbose, save_best_only=True,
                         save_weights_only=False, mode=mode, save_freq=save_freq)
        self.filepath = filepath

    def on_train_begin(self, logs: Any = None) -> None:
        if self.filepath is None:
            raise InvalidArgumentError("BestModelCheckpoint has no filepath: pass filepath='best.keras' or set "
                                       "callback.filepath before model.fit")
        super().on_train_begin(logs)

    def _save_model(self, *args: Any, **kwargs: Any) -> None:
        if ptorch.rank() == 0:
            super()._save_model(*args, **kwargs)


class MetricAverageCallback(keras.callbacks.Callback):
    """Average the epoch's metrics (``logs``) across ranks at the end of each epoch, in one collective.

    Put it before callbacks that read metrics (checkpointing, early stopping, LR schedules on plateau).

    Args:
        device: accepted for Horovod compatibility.
    """

    def __init__(self, device: str = "") -> None:
        super().__init__()

    def on_epoch_end(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        """Replace every numeric metric in ``logs`` by its average over ranks."""
        if not logs:
            return
        keys = sorted(k for k, v in logs.items() if np.ndim(v) == 0 and isinstance(float(v), float))
        values = np.array([float(logs[k]) for k in keys], dtype=np.float64)
        name = "MetricAverageCallback:" + ",".join(keys)[:90]
        averaged = _bridge.np_allreduce(values, name, frontend.Average, 1.0, 1.0)
        for key, value in zip(keys, averaged.tolist()):
            logs[key] = value


def _set_lr(model: Any, value: float) -> None:
    model.optimizer.learning_rate = value


def _built(optimizer: Any) -> bool:
    return bool(getattr(optimizer, "built", getattr(optimizer, "_built", False)))  # Keras 3 / Keras 2


def _is_legacy(optimizer: Any) -> bool:
    """A Keras 2 legacy optimizer (``tf_keras.optimizers.legacy``): hyperparameters are variables."""
    return hasattr(optimizer, "_hyper") and hasattr(optimizer, "_set_hyper")


def _momentum_slots(optimizer: Any) -> list[Any] | None:
    """The momentum variables of an SGD / RMSprop with momentum ([] without momentum); None: not correctable.

    Both update ``m = momentum * m +/- lr * g`` with ``momentum`` compiled in as a constant, so Horovod's
    correction (``momentum * new_lr / old_lr`` for the step after a change) is ``m *= new_lr / old_lr`` first.
    """
    opt = getattr(optimizer, "inner_optimizer", optimizer)  # a LossScaleOptimizer's own optimizer
    if not float(getattr(opt, "momentum", 0.0) or 0.0):
        return []
    if isinstance(opt, keras.optimizers.SGD):
        return list(opt.momentums) if _built(opt) else []
    if isinstance(opt, keras.optimizers.RMSprop):
        return list(opt._momentums) if _built(opt) else []
    return None


def _with_momentums(optimizer: Any, model: Any) -> list[tuple[Any, Any]]:
    """Each variable an SGD trains, with its momentum slot (Keras 3, or Keras 2's new SGD, which keeps
    the slots in the order of an index it built on the model's variables)."""
    if hasattr(optimizer, "_trainable_variables"):
        return list(zip(optimizer._trainable_variables, optimizer.momentums))
    index = optimizer._index_dict
    keyed = [(v, index.get(optimizer._var_key(v))) for v in model.trainable_variables]
    return [(v, optimizer.momentums[i]) for v, i in keyed if i is not None]


class _MomentumCorrection:
    """Horovod's momentum correction for one optimizer (exact for SGD, RMSprop and SGD(nesterov=True)).

    Keras 3 and Keras 2's new optimizers compile ``momentum`` in, so the momentum buffers are scaled
    instead; Keras 2's legacy optimizers get Horovod's own correction: ``momentum`` (a variable there) is
    ``momentum * new_lr / old_lr`` for one step, then restored.
    """

    def __init__(self) -> None:
        self.warned = False
        self.nesterov_fix: tuple[Any, float] | None = None  # (optimizer, momentum * (ratio - 1)) for one step
        self.restore_momentum: tuple[Any, float] | None = None  # (legacy optimizer, its momentum)

    def rescale(self, optimizer: Any, old_lr: float, new_lr: float) -> None:
        """Before the first step at ``new_lr``: scale the momentum buffers by ``new_lr / old_lr``."""
        opt = getattr(optimizer, "inner_optimizer", optimizer)
        if _is_legacy(opt) and "momentum" in opt._hyper:
            self._rescale_legacy(opt, old_lr, new_lr)
            return
        slots = _momentum_slots(optimizer)
        if slots is None:
            if not self.warned:
                warnings.warn(f"momentum_correction is not applied to {type(optimizer).__name__} (phalanx "
                              "corrects SGD and RMSprop momentum); pass momentum_correction=False to silence "
                              "this", stacklevel=3)
                self.warned = True
            return
        if not slots or old_lr == 0.0 or new_lr == old_lr:
            return
        ratio = new_lr / old_lr
        for m in slots:
            m.assign(m * ratio)
        if getattr(opt, "nesterov", False):  # its weight update uses momentum once more: fixed after the step
            self.nesterov_fix = (opt, float(opt.momentum) * (ratio - 1.0))

    def _rescale_legacy(self, opt: Any, old_lr: float, new_lr: float) -> None:
        momentum = float(self.restore_momentum[1] if self.restore_momentum else opt._get_hyper("momentum"))
        if not momentum or old_lr == 0.0 or new_lr == old_lr:
            return
        self.restore_momentum = (opt, momentum)
        opt._set_hyper("momentum", momentum * new_lr / old_lr)

    def after_step(self, model: Any) -> None:
        """Undo a legacy optimizer's one-step momentum; SGD(nesterov=True): add the rest of Horovod's
        corrected update (``(momentum' - momentum) * m``)."""
        if self.restore_momentum is not None:
            opt, momentum = self.restore_momentum
            self.restore_momentum = None
            opt._set_hyper("momentum", momentum)
        if self.nesterov_fix is None:
            return
        opt, extra = self.nesterov_fix
        self.nesterov_fix = None
        for v, m in _with_momentums(opt, model):
            v.assign_add(m * extra)


class LearningRateScheduleCallback(keras.callbacks.Callback):
    """Set the learning rate to ``initial_lr * multiplier(epoch)`` from ``start_epoch`` to ``end_epoch``.

    Args:
        initial_lr: the base learning rate (usually already scaled by ``hvd.size()``).
        multiplier: a constant, or a function of the (fractional, when not ``staircase``) epoch.
        start_epoch: first epoch the schedule applies to.
        end_epoch: first epoch it no longer applies to (None: until the end).
        staircase: change once per epoch (True) or every batch with a fractional epoch (False).
        momentum_correction: when the learning rate changes, rescale the momentum of an SGD or RMSprop
            optimizer by ``new_lr / old_lr`` for the next step (Horovod's correction, by scaling the momentum
            buffers: Keras 3 compiles ``momentum`` in as a constant); other optimizers with a ``momentum``
            get a warning.
        steps_per_epoch: batches per epoch for ``staircase=False`` (default: what ``fit`` reports).
    """

    def __init__(self, initial_lr: float, multiplier: float | Callable[[float], float], start_epoch: int = 0,
                 end_epoch: int | None = None, staircase: bool = True, momentum_correction: bool = True,
                 steps_per_epoch: int | None = None) -> None:
        super().__init__()
        self.initial_lr = initial_lr
        self.multiplier = multiplier if callable(multiplier) else (lambda _epoch: multiplier)
        self.start_epoch, self.end_epoch = start_epoch, end_epoch
        self.staircase = staircase
        self.momentum_correction = momentum_correction
        self.steps_per_epoch = steps_per_epoch
        self.current_epoch = 0
        self._correction = _MomentumCorrection()

    def _set(self, value: float) -> None:
        optimizer = self.model.optimizer
        old = float(optimizer.learning_rate)
        _set_lr(self.model, value)
        if self.momentum_correction:
            self._correction.rescale(optimizer, old, float(optimizer.learning_rate))

    def _active(self, epoch: int) -> bool:
        return epoch >= self.start_epoch and (self.end_epoch is None or epoch < self.end_epoch)

    def _steps(self) -> int:
        steps = self.steps_per_epoch or (self.params or {}).get("steps")
        if not steps:
            raise InvalidArgumentError("LearningRateScheduleCallback(staircase=False) needs steps_per_epoch= (fit does "
                             "not know the number of steps of this dataset)")
        return int(steps)

    def on_epoch_begin(self, epoch: int, logs: Any = None) -> None:
        """Staircase: set the epoch's learning rate."""
        self.current_epoch = epoch
        if self.staircase and self._active(epoch):
            self._set(self.initial_lr * self.multiplier(epoch))

    def on_train_batch_begin(self, batch: int, logs: Any = None) -> None:
        """Smooth schedule: set the learning rate of a fractional epoch."""
        if not self.staircase and self._active(self.current_epoch):
            epoch = self.current_epoch + batch / self._steps()
            self._set(self.initial_lr * self.multiplier(epoch))

    def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
        """Finish a momentum correction."""
        self._correction.after_step(self.model)


class LearningRateWarmupCallback(LearningRateScheduleCallback):
    """Ramp the learning rate from ``initial_lr / size`` to ``initial_lr`` over ``warmup_epochs`` (Goyal et al.).

    Horovod's formula: ``lr = initial_lr / size * (epoch * (size - 1) / warmup_epochs + 1)`` with a fractional
    epoch, updated every batch.

    Args:
        initial_lr: the learning rate after warmup (usually ``base_lr * hvd.size()``).
        warmup_epochs: epochs of warmup.
        momentum_correction: rescale SGD / RMSprop momentum on each change (see LearningRateScheduleCallback).
        steps_per_epoch: batches per epoch (default: what ``fit`` reports).
        verbose: 1 prints a line when warmup ends.
    """

    def __init__(self, initial_lr: float, warmup_epochs: int = 5, momentum_correction: bool = True,
                 steps_per_epoch: int | None = None, verbose: int = 0) -> None:
        def multiplier(epoch: float) -> float:
            size = ptorch.size()
            return 1.0 / size * (epoch * (size - 1) / warmup_epochs + 1)

        super().__init__(initial_lr, multiplier, start_epoch=0, end_epoch=warmup_epochs, staircase=False,
                         momentum_correction=momentum_correction, steps_per_epoch=steps_per_epoch)
        self.warmup_epochs = warmup_epochs
        self.verbose = verbose

    def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
        """At the end of warmup, set exactly ``initial_lr`` (and say so when ``verbose``)."""
        if epoch == self.warmup_epochs - 1:
            self._set(self.initial_lr)
            if self.verbose and ptorch.rank() == 0:
                io_utils.print_msg(f"\nEpoch {epoch + 1}: finished learning rate warmup to {self.initial_lr:g}.")
