"""phalanx.torch with no launcher: one rank on a private in-process store; errors before init."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist

import phalanx.torch as hvd


@pytest.fixture
def single(no_launcher: None) -> Iterator[None]:
    hvd.init()
    yield
    hvd.shutdown()
    assert not dist.is_initialized()


def test_every_call_before_init_says_to_call_init() -> None:
    assert not hvd.is_initialized()
    calls = [hvd.size, hvd.rank, hvd.local_rank, hvd.cross_size, lambda: hvd.allreduce(torch.ones(1)),
             lambda: hvd.barrier(), lambda: hvd.broadcast_object(1),
             lambda: hvd.DistributedOptimizer(torch.optim.SGD(torch.nn.Linear(1, 1).parameters(), lr=0.1))]
    for call in calls:
        with pytest.raises(ValueError, match=r"hvd\.init\(\)"):
            call()


def test_size_one_without_launcher(single: None) -> None:
    assert (hvd.size(), hvd.rank(), hvd.local_size(), hvd.local_rank(), hvd.cross_size()) == (1, 0, 1, 0, 1)
    assert hvd.is_initialized() and hvd.gloo_enabled() and not hvd.mpi_enabled() and not hvd.mpi_built()
    assert not hvd.ddl_built() and not hvd.ccl_built() and not hvd.mpi_threads_supported()
    assert isinstance(hvd.nccl_built(), bool) and isinstance(hvd.cuda_built(), bool)
    x = torch.arange(6.0).view(2, 3)
    assert torch.equal(hvd.allreduce(x), x) and torch.equal(hvd.allreduce(x, op=hvd.Sum, postscale_factor=2), 2 * x)
    assert torch.equal(hvd.allgather(x), x) and torch.equal(hvd.broadcast(x, 0), x)
    assert torch.equal(hvd.alltoall(x), x)  # without splits: the tensor alone (Horovod)
    out, received = hvd.alltoall(x, splits=[2])
    assert torch.equal(out, x) and received.tolist() == [2]
    assert torch.equal(hvd.reducescatter(x), x)
    assert hvd.broadcast_object({"a": 1}) == {"a": 1} and hvd.allgather_object(3) == [3]
    h = hvd.allreduce_async(x, name="n")
    with pytest.raises(ValueError, match="already in flight"):
        hvd.allreduce_async(x, name="n")
    deadline = time.monotonic() + 60
    while not hvd.poll(h):  # the background thread runs it; poll never blocks
        assert time.monotonic() < deadline, "the *_async allreduce did not finish within 60 s"
        time.sleep(0.001)
    assert torch.equal(hvd.synchronize(h), x)
    with pytest.raises(ValueError, match="unknown"):
        hvd.synchronize(h)
    assert hvd.join() == 0
    hvd.init()  # idempotent


def test_distributed_optimizer_at_size_one_is_the_plain_optimizer(single: None) -> None:
    torch.manual_seed(0)
    a = torch.nn.Linear(3, 2)
    b = torch.nn.Linear(3, 2)
    b.load_state_dict(a.state_dict())
    plain = torch.optim.Adam(a.parameters(), lr=0.1)
    wrapped = hvd.DistributedOptimizer(torch.optim.Adam(b.parameters(), lr=0.1), named_parameters=b.named_parameters())
    assert isinstance(wrapped, torch.optim.Adam)
    for _ in range(3):
        for model, opt in ((a, plain), (b, wrapped)):
            opt.zero_grad()
            model(torch.ones(4, 3)).sum().backward()
            opt.step()
    assert torch.equal(a.weight, b.weight)


def test_optimizer_name_validation(single: None) -> None:
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
    named = list(model.named_parameters())
    with pytest.raises(ValueError, match="unique"):
        hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=named + named[:1])
    with pytest.raises(ValueError, match="not named"):
        hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=named[:2])
    with pytest.raises(ValueError, match="tuples"):
        hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=list(model.parameters()))
    with pytest.raises(NotImplementedError):
        hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), op=hvd.Adasum)


def test_process_set_rules(single: None) -> None:
    assert hvd.global_process_set.process_set_id == 0 and hvd.global_process_set.size() == 1
    with pytest.raises(ValueError, match="HOROVOD_DYNAMIC_PROCESS_SETS"):
        hvd.add_process_set([0])
    with pytest.raises(ValueError, match="distinct"):
        hvd.ProcessSet([0, 0])
    assert hvd.remove_process_set(hvd.global_process_set) is False


def test_init_rejects_mpi_communicators() -> None:
    with pytest.raises(ValueError, match="comm"):
        hvd.init(comm=object())


def test_sync_batch_norm_at_size_one_matches_batch_norm(single: None) -> None:
    torch.manual_seed(0)
    x = torch.randn(6, 3, 4)
    ref, sync = torch.nn.BatchNorm1d(3), hvd.SyncBatchNorm(3)
    assert torch.allclose(ref(x), sync(x), atol=1e-6)
    assert torch.allclose(ref.running_var, sync.running_var)
    ref.eval()
    sync.eval()
    assert torch.allclose(ref(x), sync(x), atol=1e-6)
