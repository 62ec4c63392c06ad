"""``hvd.shutdown()`` is phalanx.torch's one reset path: after it nothing of the last ``hvd.init()`` is left
(engine, process sets, background jobs, stall watch, topology, process group), and ``hvd.init()`` starts
afresh. The state is private (``_runtime.RUNTIME``): no public name shows it, so these tests read it."""

from __future__ import annotations

import importlib
import pkgutil

import torch
import torch.distributed as dist

import phalanx.torch as hvd

# white-box: the runtime object's reset, which is what this tests (no public name)
from phalanx.torch import _runtime
from phalanx.torch._engine import core as _engine
from phalanx.torch._runtime import RUNTIME, Inspector, ProcessState, Registry


def _use_everything() -> None:
    hvd.init(process_sets="dynamic")
    hvd.allreduce(torch.ones(4), name="named")
    hvd.synchronize(hvd.allreduce_async(torch.ones(4), name="async"))
    pending = hvd.allgather_async(torch.ones(2), name="left pending")  # never synchronized
    assert hvd.synchronize(pending).shape == (2,)
    hvd.allgather_async(torch.ones(3), name="dropped")  # its handle is dropped
    hvd.grouped_allreduce_async([torch.ones(2), torch.ones(3)], name="grouped, dropped")
    hvd.allreduce(torch.ones(2), process_set=hvd.global_process_set, name="in the global set")


def _assert_fresh() -> None:
    assert not dist.is_initialized() and not hvd.is_initialized()
    assert RUNTIME.process == ProcessState()
    engine = RUNTIME.engine
    assert not (engine.queue or engine.handles or engine.inflight or engine.predictors or engine.rounds
                or engine.issued or engine.tables)
    assert RUNTIME.registry == Registry()
    assert not RUNTIME.grouped.members
    assert hvd.global_process_set.process_set_id is None
    runner = RUNTIME.runner
    assert not (runner.queue or runner.jobs or runner.busy or runner.inflight or runner.finished)
    fresh = {k: v for k, v in vars(Inspector()).items() if not callable(v)}
    assert {k: v for k, v in vars(RUNTIME.inspector).items() if not callable(v)} == fresh
    assert RUNTIME.watcher.store is None


def test_shutdown_then_init_leaves_nothing_stale(no_launcher: None) -> None:
    _use_everything()
    hvd.shutdown()
    _assert_fresh()
    _use_everything()  # the same names again: nothing of the first init is in the way
    assert hvd.global_process_set.process_set_id == 0 and RUNTIME.registry.dynamic
    hvd.shutdown()
    _assert_fresh()


def test_the_engine_of_a_new_init_is_the_one_every_module_reads(no_launcher: None) -> None:
    hvd.init()
    first = RUNTIME.engine
    hvd.shutdown()
    hvd.init()  # what hvd.elastic.run's reset does
    try:
        assert RUNTIME.engine is not first
        RUNTIME.engine.rounds[(0, 1)] = 7
        assert _engine.rounds((0, 1)) == 7  # hvd.join() orders the joined ranks by these counts
    finally:
        hvd.shutdown()


def _state_types() -> tuple[type, ...]:
    return tuple(v for v in vars(_runtime).values() if isinstance(v, type) and v.__module__ == _runtime.__name__)


def test_every_piece_of_state_lives_in_the_runtime() -> None:
    """No module of phalanx.torch holds one of the Runtime's state objects itself (it would outlive a reset)."""
    held = {}
    for info in pkgutil.walk_packages(hvd.__path__, "phalanx.torch."):
        module = importlib.import_module(info.name)
        for name, value in vars(module).items():
            if isinstance(value, _state_types()) and value is not RUNTIME:
                held[f"{info.name}.{name}"] = type(value).__name__
    assert held == {}
