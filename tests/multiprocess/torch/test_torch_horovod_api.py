"""Horovod's documented semantics that phalanx.torch keeps: init after shutdown, alltoall's return value,
gradients of the grouped and reduce-scatter collectives, sparse allreduce, the DistributedOptimizer's corner
cases and ``broadcast_optimizer_state``'s."""

from __future__ import annotations

import os
import time
import warnings
from typing import Any

import pytest

import phalanx

pytestmark = [pytest.mark.multiprocess]


def _reinit_job() -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    import phalanx.torch as hvd

    out: dict[str, Any] = {"ids": [], "sums": []}
    for _ in range(3):
        hvd.init()
        hvd.init()  # idempotent
        out["ids"].append((hvd.rank(), hvd.size()))
        out["sums"].append(hvd.allreduce(torch.ones(3), op=hvd.Sum).tolist())
        if hvd.rank() == 1:  # joins last: every rank must say so in every generation (the current engine's
            hvd.allreduce(torch.ones(3), name="served")  # round counts, not the first init's)
        out.setdefault("last joined", []).append(hvd.join())
        hvd.shutdown()
        out["after shutdown"] = hvd.is_initialized()
    me = int(os.environ["RANK"])
    hvd.init()
    start = time.monotonic()
    store = dist.distributed_c10d._get_default_store()  # the job's store outlives the generations
    try:  # rank 1 waits in a collective that rank 0 abandons by calling shutdown() and init() again
        if me == 1:
            store.set("rank 1 issues 'abandoned'", "1")
            hvd.allreduce(torch.ones(3), name="abandoned")
        else:
            store.wait(["rank 1 issues 'abandoned'"])  # rank 0 moves on once rank 1 has issued it
            hvd.shutdown()
            hvd.init()
        out["moved on"] = "no error"
    except RuntimeError as e:
        out["moved on"] = str(e)
        out["seconds"] = time.monotonic() - start
        hvd.init()  # rejoins rank 0's generation
    out["rejoined"] = hvd.allreduce(torch.ones(2), op=hvd.Sum, name="rejoined").tolist()
    hvd.shutdown()
    return out


@pytest.mark.timeout(120)
def test_init_after_shutdown_and_a_peer_that_moved_on() -> None:
    reports = phalanx.run(_reinit_job, np=2, env={"PHALANX_STALL_CHECK_S": "1"})
    for r, report in enumerate(reports):
        assert report["ids"] == [(r, 2)] * 3 and report["sums"] == [[2.0] * 3] * 3
        assert report["last joined"] == [1, 1, 1]
        assert report["after shutdown"] is False
        assert report["rejoined"] == [2.0, 2.0]
    assert reports[0]["moved on"] == "no error"
    error = reports[1]["moved on"]
    assert "rank(s) [0] left hvd.init() #4 of rank 1" in error and "rank 0 is in hvd.init() #5" in error, error
    assert reports[1]["seconds"] < 30  # the stall check (1 s) finds it, not a transport timeout


def _late_peer_job() -> str:
    import phalanx.torch as hvd

    hvd.init()
    if int(os.environ["RANK"]) == 1:
        return "late"  # never calls init() again (its process ends; the launcher's store stays)
    hvd.shutdown()
    try:
        hvd.init()
        return "no error"
    except RuntimeError as e:
        return f"{type(e).__name__}: {e}"


@pytest.mark.timeout(60)
def test_init_that_misses_a_peer_names_it_within_the_start_timeout() -> None:
    # the gloo timeout also bounds every gloo operation: not so short that a loaded host trips it elsewhere
    error, late = phalanx.run(_late_peer_job, np=2, env={"HOROVOD_GLOO_TIMEOUT_SECONDS": "6"})
    assert late == "late"
    assert error.startswith("HorovodInternalError: rank 0 waited 6 s in hvd.init() #2 for rank(s) [1]"), error
    assert "rank 1 is in hvd.init() #1" in error and "HOROVOD_GLOO_TIMEOUT_SECONDS" in error, error


def _check_alltoall_and_grads(fail: list[str], n: int, me: int) -> None:
    import torch

    import phalanx.torch as hvd

    t = torch.arange(2.0 * n) + 100 * me
    alone = hvd.alltoall(t)
    if not isinstance(alone, torch.Tensor) or alone.tolist() != [2.0 * me + 100 * r + k for r in range(n)
                                                                  for k in range(2)]:
        fail.append(f"alltoall without splits: {alone}")
    pair = hvd.alltoall(t, splits=[2] * n)
    if not isinstance(pair, tuple) or pair[1].tolist() != [2] * n:
        fail.append(f"alltoall with splits: {pair}")
    for op, scale in ((hvd.Sum, n), (hvd.Average, 1)):  # Horovod: the allgathered gradient, times n for Sum
        v = torch.ones(n, 2, requires_grad=True)
        hvd.reducescatter(v, op=op, prescale_factor=2.0).sum().backward()
        if not torch.allclose(v.grad, torch.full((n, 2), 2.0 * scale)):
            fail.append(f"reducescatter grad op={op}: {v.grad.tolist()}")
    a, b = torch.ones(n, 2, requires_grad=True), torch.ones(2 * n, requires_grad=True)
    ra, rb = hvd.grouped_reducescatter([a, b], op=hvd.Sum)
    (ra.sum() + 3 * rb.sum()).backward()
    if not (torch.allclose(a.grad, torch.full((n, 2), 1.0 * n)) and torch.allclose(b.grad, torch.full((2 * n,), 3.0 * n))):  # noqa: E501
        fail.append(f"grouped_reducescatter grad {a.grad.tolist()} {b.grad.tolist()}")
    x, y = torch.ones(me + 1, 2, requires_grad=True), torch.ones(1, requires_grad=True)
    gx, gy = hvd.grouped_allgather([x, y])
    ((gx * torch.arange(gx.shape[0]).unsqueeze(1)).sum() + 5 * gy.sum()).backward()
    offset = sum(range(1, me + 1))  # rows of the lower ranks; the gradient is averaged over the ranks
    if not torch.allclose(x.grad, torch.arange(offset, offset + me + 1).unsqueeze(1).float().expand(me + 1, 2)):
        fail.append(f"grouped_allgather grad {x.grad.tolist()}")
    if not torch.allclose(y.grad, torch.full((1,), 5.0)):
        fail.append(f"grouped_allgather grad {y.grad.tolist()}")


def _check_sparse(fail: list[str], n: int, me: int) -> None:
    import torch

    import phalanx.torch as hvd

    dense = torch.zeros(6, 3)
    dense[me] = me + 1.0
    dense[5] = 1.0
    for op in (hvd.Average, hvd.Sum):
        wait = hvd.sparse_allreduce_async(dense.to_sparse(), name=f"sparse.{op}", op=op)
        got = wait().to_dense()
        if not torch.allclose(got, hvd.allreduce(dense, op=op)):
            fail.append(f"sparse_allreduce_async op={op}: {got.tolist()}")
    for as_dense in (False, True):
        torch.manual_seed(0)
        emb = torch.nn.Embedding(8, 2, sparse=True)
        opt = hvd.DistributedOptimizer(torch.optim.SparseAdam(list(emb.parameters()), lr=0.1),
                                       sparse_as_dense=as_dense)
        emb(torch.tensor([[me, 7]])).sum().backward()
        opt.synchronize()
        grad = emb.weight.grad
        want = torch.zeros(8, 2)
        want[:n] += 1.0 / n
        want[7] = 1.0
        if grad is None or not grad.is_sparse or not torch.allclose(grad.to_dense(), want):
            fail.append(f"sparse grad (sparse_as_dense={as_dense}): {grad}")
        with opt.skip_synchronize():
            opt.step()


def _check_optimizer(fail: list[str], n: int, me: int) -> None:
    import torch

    import phalanx.torch as hvd

    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 1))
    sgd = torch.optim.SGD([{"params": model[0].parameters()}, {"params": model[1].parameters()}], lr=0.1)
    opt = hvd.DistributedOptimizer(sgd)
    names = sorted(opt._parameter_names.values())
    if names != ["allreduce.noname.0.0", "allreduce.noname.0.1", "allreduce.noname.1.0", "allreduce.noname.1.1"]:
        fail.append(f"default names {names}")
    model(torch.ones(1, 2) * (me + 1)).sum().backward()
    opt.synchronize()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        opt.step()
    if len(seen) != 1 or "optimizer.step() called without optimizer.skip_synchronize()" not in str(seen[0].message):
        fail.append(f"synchronize()+step() warnings: {[str(w.message) for w in seen]}")
    alone = hvd.add_process_set([0])  # rank 1 builds an optimizer on a set it is not in: it steps alone
    local = torch.nn.Linear(2, 1)
    torch.nn.init.constant_(local.weight, 1.0)
    opt2 = hvd.DistributedOptimizer(torch.optim.SGD(local.parameters(), lr=1.0), process_set=alone)
    local(torch.ones(1, 2) * (me + 1)).sum().backward()
    opt2.step()
    if local.weight.tolist() != [[1.0 - (me + 1), 1.0 - (me + 1)]]:
        fail.append(f"optimizer on a set: {local.weight.tolist()}")
    hvd.remove_process_set(alone)


def _check_optimizer_state(fail: list[str], me: int) -> None:
    import torch

    import phalanx.torch as hvd

    class NoGrad(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.index = torch.nn.Parameter(torch.tensor([1, 0]), requires_grad=False)
            self.w = torch.nn.Parameter(torch.ones(3) * (me + 1))

    model = NoGrad()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    hvd.broadcast_optimizer_state(opt, 0, model)  # Horovod's third positional parameter is the model
    if model.index.grad is not None or model.w.grad is None or "momentum_buffer" not in opt.state[model.w]:
        fail.append(f"state of a model with a frozen parameter: {model.index.grad} {model.w.grad}")
    emb = torch.nn.Embedding(4, 2, sparse=True)
    sparse_adam = torch.optim.SparseAdam(list(emb.parameters()), lr=0.1 * (me + 1))
    hvd.broadcast_optimizer_state(sparse_adam, root_rank=0)
    if sparse_adam.param_groups[0]["lr"] != 0.1 or "exp_avg" not in sparse_adam.state[emb.weight]:
        fail.append(f"SparseAdam state {sparse_adam.param_groups[0]['lr']}")


def _api_job() -> list[str]:
    import phalanx.torch as hvd

    hvd.init(process_sets="dynamic")
    n, me = hvd.size(), hvd.rank()
    fail: list[str] = []
    _check_alltoall_and_grads(fail, n, me)
    _check_sparse(fail, n, me)
    _check_optimizer(fail, n, me)
    _check_optimizer_state(fail, me)
    hvd.shutdown()
    return fail


@pytest.mark.timeout(120)
def test_horovod_api_semantics() -> None:
    assert phalanx.run(_api_job, np=2) == [[], []]
