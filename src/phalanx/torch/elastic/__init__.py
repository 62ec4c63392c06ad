"""Elastic training (Horovod's ``hvd.elastic``): lose a worker, keep the work since the last commit.

``import phalanx.torch as hvd``; decorate the training function with ``@hvd.elastic.run``, keep what must
survive in ``hvd.elastic.TorchState(model, optimizer, epoch=0, batch=0)`` and call ``state.commit()``
every few steps. Launch with ``phalanx.run(fn, np=N, min_np=A, max_np=B)`` or ``phalanxrun --min-np``.
See ``docs/elastic.md``.
"""

from __future__ import annotations

from phalanx.errors import HorovodInternalError, HostsUpdatedInterrupt
from phalanx.torch.elastic._run import run
from phalanx.torch.elastic.handlers import (
    ModelStateHandler,
    OptimizerStateHandler,
    SamplerStateHandler,
    StateHandler,
    get_handler_registry,
    set_handler_registry,
)
from phalanx.torch.elastic.sampler import ElasticSampler
from phalanx.torch.elastic.state import HostUpdateResult, ObjectState, State, TorchState

__all__ = ["ElasticSampler", "HorovodInternalError", "HostUpdateResult", "HostsUpdatedInterrupt",
           "ModelStateHandler", "ObjectState", "OptimizerStateHandler", "SamplerStateHandler", "State",
           "StateHandler", "TorchState", "get_handler_registry", "run", "set_handler_registry"]
