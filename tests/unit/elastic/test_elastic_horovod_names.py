"""Horovod's elastic names and their semantics: State hooks, ObjectState's functions, the handler registry."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import phalanx.torch as hvd
from phalanx.env import names as env_names
from phalanx.errors import HostsUpdatedInterrupt
from phalanx.torch.elastic import state as state_module


class Rank0:
    """A stand-in for rank 0's broadcast: returns what rank 0 holds, counts calls."""

    def __init__(self, value: Any = None) -> None:
        self.value = value
        self.sent: list[Any] = []

    def __call__(self, obj: Any) -> Any:
        self.sent.append(obj)
        return obj if self.value is None else self.value


def test_object_state_takes_horovods_functions(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    bcast = Rank0({"epoch": 4, "lr": 0.5})
    state = hvd.elastic.ObjectState(bcast, lambda: 1, epoch=0, lr=0.1)
    assert (state.epoch, state.lr) == (0, 0.1)
    state.sync()
    assert bcast.sent == [{"epoch": 0, "lr": 0.1}] and (state.epoch, state.lr) == (4, 0.5)
    monkeypatch.setenv(env_names.PHALANX_ELASTIC_CHECKPOINT_DIR, str(tmp_path))
    state.commit()  # get_rank() says 1: only rank 0 writes the durable commit
    assert not (tmp_path / "state.pt").exists()


def test_sync_sends_the_last_commit_not_uncommitted_changes() -> None:
    bcast = Rank0()
    state = hvd.elastic.ObjectState(bcast, lambda: 0, step=1)
    state.step = 2
    state.save()
    state.step = 3  # not committed
    state.sync()
    assert bcast.sent == [{"step": 2}] and state.step == 2


def test_on_reset_runs_reset_before_the_callbacks_and_drops_host_messages() -> None:
    order: list[str] = []

    class Mine(hvd.elastic.ObjectState):
        def reset(self) -> None:
            order.append("reset")

    state = Mine(Rank0(), lambda: 0, n=0)
    state.register_reset_callbacks([lambda: order.append("callback")])
    state.on_hosts_updated(5.0, hvd.elastic.HostUpdateResult.added)
    state.on_reset()
    assert order == ["reset", "callback"]
    state.check_host_updates()  # the message was dropped by the reset: nothing raised


@pytest.mark.parametrize(
    ("updates", "skip_sync"),
    [
        ([(1.0, "removed")], True),
        ([(1.0, "added")], False),
        ([(1.0, "removed"), (2.0, "added")], False),
        ([(2.0, "removed"), (1.0, "added")], True),  # an older message does not count
    ],
)
def test_host_updates_raise_once_per_newer_timestamp(updates: list[tuple[float, str]], skip_sync: bool) -> None:
    state = hvd.elastic.ObjectState(Rank0(), lambda: 0, n=0)
    for timestamp, result in updates:
        state.on_hosts_updated(timestamp, hvd.elastic.HostUpdateResult[result])
    with pytest.raises(HostsUpdatedInterrupt) as caught:
        state.commit()
    assert caught.value.skip_sync is skip_sync
    state.on_hosts_updated(1.0, hvd.elastic.HostUpdateResult.added)  # not newer than the one handled
    state.check_host_updates()


def test_default_registry_gives_torch_state_its_handlers() -> None:
    from phalanx.torch.elastic.handlers import ResumableLoader

    kinds = [kind for kind, _ in hvd.elastic.get_handler_registry()]
    assert kinds == [torch.nn.Module, torch.optim.Optimizer, hvd.elastic.ElasticSampler, ResumableLoader]
    model, other = torch.nn.Linear(2, 1), torch.nn.Linear(1, 1)
    sampler = hvd.elastic.ElasticSampler(list(range(8)), shuffle=False)
    state = hvd.elastic.TorchState(model, None, encoder=other, sampler=sampler, epoch=0)
    handlers = {name: type(h) for name, h in state._handlers.items()}
    assert handlers == {"model": hvd.elastic.ModelStateHandler, "encoder": hvd.elastic.ModelStateHandler,
                        "sampler": hvd.elastic.SamplerStateHandler}
    sampler.record_batch(batch_idx=0, batch_size=2)
    with torch.no_grad():
        other.weight.fill_(7.0)
    state.epoch = 1
    state.restore()
    assert sampler.processed_num == 0 and list(sampler) == list(range(8))
    assert not torch.equal(other.weight, torch.full_like(other.weight, 7.0)) and state.epoch == 0


def test_a_resumable_loader_keeps_its_position_in_torch_state() -> None:
    """A loader that declares elastic_resumable is saved, restored and written by a durable commit."""
    from phalanx.torch.elastic.handlers import LoaderStateHandler

    class Loader:
        elastic_resumable = True

        def __init__(self) -> None:
            self.position = 0

        def state_dict(self) -> dict[str, int]:
            return {"position": self.position}

        def load_state_dict(self, state: dict[str, int]) -> None:
            self.position = state["position"]

    loader = Loader()
    state = hvd.elastic.TorchState(None, None, loader=loader, epoch=0)
    assert type(state._handlers["loader"]) is LoaderStateHandler
    loader.position = 5
    state.save()
    loader.position = 9
    state.restore()
    assert loader.position == 5 and state.durable()["handlers"]["loader"] == {"position": 5}


def test_assigning_a_handled_attribute_hands_the_new_object_over() -> None:
    state = hvd.elastic.TorchState(torch.nn.Linear(2, 1))
    new = torch.nn.Linear(2, 1)
    with torch.no_grad():
        new.weight.fill_(3.0)
    state.model = new  # saved at once, as Horovod's set_value does
    with torch.no_grad():
        new.weight.fill_(5.0)
    state.restore()
    assert state._handlers["model"].value is new and torch.equal(new.weight, torch.full_like(new.weight, 3.0))


class Counter:
    """A user type with its own handler."""

    def __init__(self) -> None:
        self.n = 0


class CounterHandler(hvd.elastic.StateHandler):
    def __init__(self, value: Counter) -> None:
        super().__init__(value)
        self.saved = value.n
        self.synced = 0

    def save(self) -> None:
        self.saved = self.value.n

    def restore(self) -> None:
        self.value.n = self.saved

    def sync(self) -> None:
        self.synced += 1


@pytest.fixture
def registry() -> Iterator[list[Any]]:
    saved = hvd.elastic.get_handler_registry()
    yield saved
    hvd.elastic.set_handler_registry(saved)


def test_set_handler_registry_adds_a_type(registry: list[Any]) -> None:
    hvd.elastic.set_handler_registry([*registry, (Counter, CounterHandler)])
    assert state_module.get_handler_registry()[-1] == (Counter, CounterHandler)  # horovod.torch.elastic.state
    counter = Counter()
    state = hvd.elastic.TorchState(None, None, counter=counter, step=0)
    handler = state._handlers["counter"]
    assert isinstance(handler, CounterHandler)
    counter.n = 4
    state.commit()
    counter.n = 9
    state.restore()
    assert counter.n == 4
    state._bcast_object = Rank0()
    state.sync()
    assert handler.synced == 1


def test_durable_checkpoint_keeps_handled_and_plain_attributes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(env_names.PHALANX_ELASTIC_CHECKPOINT_DIR, str(tmp_path))
    model, sampler = torch.nn.Linear(2, 1), hvd.elastic.ElasticSampler(list(range(6)), shuffle=False)
    sampler.record_batch(0, 2)
    state = hvd.elastic.TorchState(model, None, sampler=sampler, epoch=3)
    state._rank = lambda: 0
    state.commit()
    fresh_sampler = hvd.elastic.ElasticSampler(list(range(6)), shuffle=False)
    fresh = hvd.elastic.TorchState(torch.nn.Linear(2, 1), None, sampler=fresh_sampler, epoch=0)
    fresh._rank = lambda: 0
    assert fresh.resume_from_checkpoint()
    assert fresh.epoch == 3 and fresh_sampler.processed_num == 2
    assert torch.equal(fresh._handlers["model"].value.weight, model.weight)


def test_horovod_common_names_resolve_to_phalanx() -> None:
    import horovod.common.elastic as elastic  # phalanx's alias (no real horovod here): what a user imports
    import horovod.common.exceptions as exceptions

    assert elastic.ObjectState is hvd.elastic.ObjectState and elastic.State is hvd.elastic.State
    assert exceptions.HostsUpdatedInterrupt is hvd.elastic.HostsUpdatedInterrupt
    assert exceptions.HorovodInternalError is hvd.elastic.HorovodInternalError
    assert state_module.ModelStateHandler is hvd.elastic.ModelStateHandler  # horovod.torch.elastic.state's names
