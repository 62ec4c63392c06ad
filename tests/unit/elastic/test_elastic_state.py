"""State classes and the sampler on one in-process rank (no launcher)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import phalanx.torch as hvd
from phalanx.env import names as env_names

# white-box: is_peer_loss: which errors re-form a world, internal to elastic.run (no public name)
from phalanx.torch.elastic._run import is_peer_loss


@pytest.fixture
def single(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    for name in (env_names.MASTER_ADDR, env_names.MASTER_PORT, env_names.RANK, env_names.WORLD_SIZE,
                 env_names.PHALANX_ELASTIC_WORKER_ID):
        monkeypatch.delenv(name, raising=False)
    hvd.init()
    yield
    hvd.shutdown()


def test_object_state_restores_the_last_commit() -> None:
    state = hvd.elastic.ObjectState(epoch=0, seen=[1])
    state.epoch, state.seen = 3, [1, 2]
    state.save()
    state.epoch = 7
    state.seen.append(9)
    state.restore()
    assert (state.epoch, state.seen) == (3, [1, 2])


def test_torch_state_restores_model_and_optimizer(single: None) -> None:
    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    state = hvd.elastic.TorchState(model, opt, step=0)
    before = model.weight.detach().clone()
    model(torch.ones(1, 2)).sum().backward()
    opt.step()
    state.step = 1
    state.restore()
    assert torch.equal(model.weight, before) and state.step == 0 and not opt.state_dict()["state"]


def test_durable_commit_is_written_and_resumed(single: None, tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(env_names.PHALANX_ELASTIC_CHECKPOINT_DIR, str(tmp_path))
    model = torch.nn.Linear(2, 1)
    state = hvd.elastic.TorchState(model, None, step=5)
    state.commit()
    assert (tmp_path / "state.pt").exists() and not list(tmp_path.glob(".*tmp"))
    fresh = hvd.elastic.TorchState(torch.nn.Linear(2, 1), None, step=0)
    assert fresh.resume_from_checkpoint()
    assert fresh.step == 5 and fresh.model is not None and torch.equal(fresh.model.weight, model.weight)


def test_reset_callbacks_and_run_without_elastic_job(single: None) -> None:
    calls: list[str] = []
    state = hvd.elastic.ObjectState(n=0)
    state.register_reset_callbacks([lambda: calls.append("reset")])
    state.on_reset()

    @hvd.elastic.run
    def train(state: hvd.elastic.ObjectState, add: int) -> int:
        state.n += add
        return int(state.n)

    assert train(state, 2) == 2 and calls == ["reset"]


def test_peer_loss_is_told_from_user_errors() -> None:
    assert is_peer_loss(RuntimeError("[gloo/pair.cc:553] Connection closed by peer [127.0.0.1]:7591"))
    assert is_peer_loss(hvd.elastic.HorovodInternalError("lost"))
    assert not is_peer_loss(ValueError("bad input"))


def test_sampler_splits_the_remaining_indices() -> None:
    sampler = hvd.elastic.ElasticSampler(list(range(10)), shuffle=False)
    assert list(sampler) == list(range(10))
    sampler.record_batch(batch_idx=1, batch_size=3)
    sampler.load_state_dict(sampler.state_dict())
    assert list(sampler) == [6, 7, 8, 9]
    shuffled = hvd.elastic.ElasticSampler(list(range(10)), seed=1)
    assert sorted(shuffled) == list(range(10)) and list(shuffled) != list(range(10))


def test_a_durable_commit_flushes_the_file_and_its_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import os
    import stat

    from phalanx.torch.elastic.state import write_atomically

    synced: list[str] = []
    real = os.fsync

    def fsync(fd: int) -> None:
        synced.append("dir" if stat.S_ISDIR(os.fstat(fd).st_mode) else "file")
        real(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    write_atomically(tmp_path / "state.pt", {"x": torch.ones(2)})
    assert synced == ["file", "dir"]  # the data before the rename, the rename after it


def test_a_failed_write_removes_its_temp_file_and_names_the_path_and_the_space(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A full disk: torch.save's short write used to leave the temp file (filling the disk) behind a
    cryptic 'unexpected pos' error."""
    from phalanx.errors import CheckpointError
    from phalanx.torch.elastic.state import write_atomically

    target = tmp_path / "state.pt"
    write_atomically(target, {"step": 1})

    def short_write(value: object, f: object) -> None:
        f.write(b"\0" * 100)  # type: ignore[attr-defined]
        raise RuntimeError("[enforce fail at inline_container.cc:778] . unexpected pos 896 vs 790")

    monkeypatch.setattr(torch, "save", short_write)
    with pytest.raises(CheckpointError, match=rf"{target}.*MiB free on its filesystem.*unexpected pos"):
        write_atomically(target, {"step": 2})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["state.pt"]  # no temp file left
    assert torch.load(target, weights_only=True) == {"step": 1}  # the last commit is intact


class Progress:
    """A user class held by an ObjectState attribute."""

    def __init__(self, epoch: int) -> None:
        self.epoch = epoch


def test_a_checkpoint_loads_weights_only_and_names_a_class_to_allow(tmp_path: Path) -> None:
    from phalanx.errors import CheckpointError
    from phalanx.torch.elastic.state import read_checkpoint, write_atomically

    path = tmp_path / "state.pt"
    write_atomically(path, {"objects": {"progress": Progress(3)}})
    with pytest.raises(CheckpointError, match="add_safe_globals"):
        read_checkpoint(path)
    with torch.serialization.safe_globals([Progress]):
        assert read_checkpoint(path)["objects"]["progress"].epoch == 3


@pytest.mark.parametrize("error", [TimeoutError("user's"), OSError("user's"), RuntimeError("user's")])
def test_a_users_exception_propagates_even_while_a_new_round_is_published(
        single: None, monkeypatch: pytest.MonkeyPatch, error: Exception) -> None:
    """Horovod re-forms only on its own collective errors (and HostsUpdatedInterrupt): a user's exception
    propagates, so the driver stops the job instead of this rank rolling back alone."""
    # white-box: a published round and its reset, stubbed inside elastic.run (no public name)
    from phalanx.torch._runtime import RUNTIME
    from phalanx.torch.elastic import _rendezvous, _run

    monkeypatch.setattr(RUNTIME.round, "store", object())
    monkeypatch.setattr(_rendezvous, "new_round_published", lambda wait_s=0.0: True)
    monkeypatch.setattr(_run, "reset", lambda deadline_s: pytest.fail("re-formed on a user's exception"))
    monkeypatch.setattr(_rendezvous, "mark_synced", lambda: None)

    @hvd.elastic.run
    def train(state: hvd.elastic.ObjectState) -> None:
        raise error

    with pytest.raises(type(error), match="user's"):
        train(hvd.elastic.ObjectState(n=0))


def test_phalanxs_own_collective_error_re_forms_when_a_new_round_is_published(
        single: None, monkeypatch: pytest.MonkeyPatch) -> None:
    from phalanx.errors import ShmTransportError

    # white-box: a published round and its reset, stubbed inside elastic.run (no public name)
    from phalanx.torch._runtime import RUNTIME
    from phalanx.torch.elastic import _rendezvous, _run

    monkeypatch.setattr(RUNTIME.round, "store", object())
    monkeypatch.setattr(_rendezvous, "new_round_published", lambda wait_s=0.0: True)
    monkeypatch.setattr(_rendezvous, "mark_synced", lambda: None)
    monkeypatch.setattr(_run, "reset", lambda deadline_s: None)
    abandoned: list[str] = []
    monkeypatch.setattr(_run.process_sets, "abandon_process_sets", abandoned.append)
    calls = [0]

    @hvd.elastic.run
    def train(state: hvd.elastic.ObjectState) -> int:
        calls[0] += 1
        if calls[0] == 1:
            raise ShmTransportError("shared-memory allreduce failed at step 3: slot reuse")
        return calls[0]

    assert train(hvd.elastic.ObjectState(n=0)) == 2
    # before rolling back alone it gives up its channels, so a peer blocked in the old round is released
    assert abandoned == ["rank 0 rolled back after ShmTransportError: shared-memory allreduce failed at step 3: "
                         "slot reuse"]
