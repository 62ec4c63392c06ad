"""Autograd through collectives, model/object helpers, optimizer-state broadcast, process sets, SyncBatchNorm."""

from __future__ import annotations

from typing import Any

import pytest

import phalanx

pytestmark = [pytest.mark.multiprocess]


def _check_autograd(fail: list[str], n: int, me: int) -> None:
    import torch

    import phalanx.torch as hvd

    x = torch.ones(4, 3, requires_grad=True)
    (hvd.allreduce(x, op=hvd.Sum) * 2).sum().backward()
    if not torch.allclose(x.grad, torch.full((4, 3), 2.0 * n)):
        fail.append(f"allreduce grad {x.grad}")
    y = torch.ones(me + 1, 2, requires_grad=True)
    g = hvd.allgather(y)
    (g * torch.arange(g.shape[0]).unsqueeze(1)).sum().backward()
    offset = sum(range(1, me + 1))
    if not torch.allclose(y.grad, torch.arange(offset, offset + me + 1).unsqueeze(1).float().expand(me + 1, 2)):
        fail.append(f"allgather grad {y.grad.tolist()}")
    z = torch.ones(3, requires_grad=True)
    hvd.broadcast(z, root_rank=0).sum().backward()
    if not torch.allclose(z.grad, torch.ones(3) * (1.0 if me == 0 else 0.0)):
        fail.append(f"broadcast grad {z.grad}")
    w = torch.ones(2 * n, requires_grad=True)
    out = hvd.alltoall(w)  # without splits: the tensor alone (Horovod)
    (out * (me + 1)).sum().backward()
    if not torch.allclose(w.grad, torch.arange(1, n + 1).repeat_interleave(2).float()):
        fail.append(f"alltoall grad {w.grad}")
    v = torch.ones(n, 2, requires_grad=True)
    hvd.reducescatter(v, op=hvd.Sum).sum().backward()
    if not torch.allclose(v.grad, torch.full((n, 2), float(n))):  # Horovod: Sum's gradient is scaled by n
        fail.append(f"reducescatter grad {v.grad}")
    a, b = torch.ones(2, requires_grad=True), torch.ones(3, requires_grad=True)
    ga, gb = hvd.grouped_allreduce([a, b], op=hvd.Sum)
    (ga.sum() + 2 * gb.sum()).backward()
    if not (torch.allclose(a.grad, torch.ones(2) * n) and torch.allclose(b.grad, torch.ones(3) * 2 * n)):
        fail.append("grouped_allreduce grad")


def _optimizers(params: Any) -> list[Any]:
    import torch

    o = torch.optim
    params = list(params)
    return [
        o.SGD(params, lr=0.1, momentum=0.9, nesterov=True), o.Adam(params, lr=0.01, betas=(0.8, 0.9), amsgrad=True),
        o.AdamW(params, lr=0.01), o.Adagrad(params, lr=0.1), o.Adadelta(params), o.Adamax(params),
        o.ASGD(params), o.NAdam(params), o.RAdam(params), o.RMSprop(params, momentum=0.5, centered=True),
        o.Rprop(params),
    ]


def _check_optimizer_state(fail: list[str], me: int) -> None:
    import torch

    import phalanx.torch as hvd

    for i in range(len(_optimizers([torch.zeros(1, requires_grad=True)]))):
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 2)
        opt = _optimizers(model.parameters())[i]
        for group in opt.param_groups:  # rank-dependent options and state that the broadcast must replace
            group["lr"] = group["lr"] * (me + 1)
        if me == 0:
            model(torch.ones(3, 4) * 0.3).sum().backward()
            opt.step()
        hvd.broadcast_optimizer_state(opt, root_rank=0)
        got = hvd.allgather_object(opt.state_dict(), name=f"state{i}")
        ref = got[0]
        for sd in got[1:]:
            if repr(sd["param_groups"]) != repr(ref["param_groups"]) or not _same_state(sd["state"], ref["state"]):
                fail.append(f"broadcast_optimizer_state {type(opt).__name__}")
        betas = opt.param_groups[0].get("betas")
        if betas is not None and not isinstance(betas, tuple):
            fail.append(f"{type(opt).__name__}: betas became {type(betas).__name__}")
    try:
        hvd.broadcast_optimizer_state(torch.optim.LBFGS(torch.nn.Linear(1, 1).parameters()), 0)
        fail.append("LBFGS accepted")
    except ValueError:
        pass


def _same_state(a: dict[Any, Any], b: dict[Any, Any]) -> bool:
    import torch

    if a.keys() != b.keys():
        return False
    for k in a:
        for key in a[k]:
            x, y = a[k][key], b[k][key]
            same = torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y
            if not same:
                return False
    return True


def _check_helpers(fail: list[str], n: int, me: int) -> None:
    import torch

    import phalanx.torch as hvd

    torch.manual_seed(me)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))
    hvd.broadcast_parameters(model.state_dict(), root_rank=1)
    flat = torch.cat([t.reshape(-1).float() for t in model.state_dict().values()])
    if not all(torch.equal(flat, other) for other in hvd.allgather_object(flat)):
        fail.append("broadcast_parameters")
    hvd.broadcast_parameters(list(model.named_parameters()), root_rank=0)
    obj = hvd.broadcast_object({"rank": me, "f": (1.5, "x")}, root_rank=n - 1)
    if obj != {"rank": n - 1, "f": (1.5, "x")}:
        fail.append(f"broadcast_object {obj}")
    fn = hvd.broadcast_object(lambda v: v + me, root_rank=0)
    if fn(1) != 1:
        fail.append("broadcast_object of a lambda")
    if hvd.allgather_object([me] * me) != [[r] * r for r in range(n)]:
        fail.append("allgather_object")


def _check_sync_batch_norm(fail: list[str], n: int, me: int) -> None:
    import torch

    import phalanx.torch as hvd

    torch.manual_seed(0)
    full = torch.randn(4 * n, 3, 5, requires_grad=True)
    ref = torch.nn.BatchNorm1d(3)
    sync = hvd.SyncBatchNorm(3)
    ref_out = ref(full)
    (ref_out * torch.arange(5.0)).sum().backward()
    mine = full.detach()[4 * me : 4 * me + 4].clone().requires_grad_()
    out = sync(mine)
    (out * torch.arange(5.0)).sum().backward()
    if not torch.allclose(out, ref_out[4 * me : 4 * me + 4], atol=1e-5):
        fail.append("SyncBatchNorm forward")
    if not torch.allclose(mine.grad, full.grad[4 * me : 4 * me + 4], atol=1e-4):
        fail.append("SyncBatchNorm input grad")
    if not torch.allclose(hvd.allreduce(sync.weight.grad, op=hvd.Sum), ref.weight.grad, atol=1e-4):
        fail.append("SyncBatchNorm weight grad")
    if not (torch.allclose(sync.running_mean, ref.running_mean, atol=1e-5)
            and torch.allclose(sync.running_var, ref.running_var, atol=1e-4)):
        fail.append("SyncBatchNorm running stats")


def _functions_job() -> list[str]:
    import phalanx.torch as hvd

    hvd.init()
    n, me = hvd.size(), hvd.rank()
    fail: list[str] = []
    for check in (_check_autograd, _check_helpers, _check_sync_batch_norm):
        check(fail, n, me)
    _check_optimizer_state(fail, me)
    hvd.shutdown()
    return fail


@pytest.mark.timeout(120)
def test_autograd_helpers_optimizer_state_and_sync_batch_norm() -> None:
    assert phalanx.run(_functions_job, np=2) == [[], []]


def _process_sets_job() -> dict[str, Any]:
    import torch

    import phalanx.torch as hvd

    even = hvd.ProcessSet([0, 2])
    hvd.init(process_sets=[even])
    me = hvd.rank()
    out: dict[str, Any] = {"even": (even.process_set_id, even.size(), even.rank(), even.included())}
    if even.included():
        out["even sum"] = hvd.allreduce(torch.ones(2) * me, op=hvd.Sum, process_set=even).tolist()
        out["even gather"] = hvd.allgather(torch.tensor([me]), process_set=even).tolist()
        out["even bcast"] = hvd.broadcast(torch.tensor([me]), root_rank=2, process_set=even).tolist()
        hvd.barrier(process_set=even)
    odd_ranks = hvd.add_process_set(reversed(range(1, 3)))  # any iterable, sorted (Horovod's rule)
    out["duplicates"] = [_raises_value(lambda ranks=ranks: hvd.add_process_set(ranks))
                         for ranks in ([2, 1], hvd.ProcessSet([0, 2]), range(3))]
    if odd_ranks.included():
        out["dyn sum"] = hvd.allreduce(torch.ones(20_000) * me, op=hvd.Sum, process_set=odd_ranks)[0].item()
        out["dyn rs"] = hvd.reducescatter(torch.ones(3, 1), op=hvd.Sum, process_set=odd_ranks).tolist()
    out["global"] = hvd.allreduce(torch.ones(1), op=hvd.Sum).item()
    out["removed"] = (hvd.remove_process_set(odd_ranks), hvd.remove_process_set(hvd.global_process_set))
    hvd.shutdown()
    return out


def _raises_value(fn: Any) -> str:
    try:
        fn()
    except ValueError as e:
        return str(e)
    return "no error"


@pytest.mark.timeout(120)
def test_static_and_dynamic_process_sets() -> None:
    r0, r1, r2 = phalanx.run(_process_sets_job, np=3, env={"HOROVOD_DYNAMIC_PROCESS_SETS": "1"})
    assert r0["even"] == (1, 2, 0, True) and r2["even"] == (1, 2, 1, True) and r1["even"] == (1, 2, -1, False)
    for r in (r0, r2):
        assert r["even sum"] == [2.0, 2.0] and r["even gather"] == [0, 2] and r["even bcast"] == [2]
    assert "even sum" not in r1
    assert r1["dyn sum"] == r2["dyn sum"] == 3.0 and "dyn sum" not in r0
    assert r1["dyn rs"] == [[2.0], [2.0]] and r2["dyn rs"] == [[2.0]]
    assert {r["global"] for r in (r0, r1, r2)} == {3.0}
    assert r0["removed"] == (True, False)
    for r in (r0, r1, r2):
        assert [d.split(" (")[0] for d in r["duplicates"]] == [
            f"Attempted to add a duplicate process set: {ranks}" for ranks in ([1, 2], [0, 2], [0, 1, 2])]


def _no_dynamic_job() -> str:
    import phalanx.torch as hvd

    hvd.init()
    try:
        hvd.add_process_set([0])
        return "no error"
    except ValueError as e:
        return str(e)
    finally:
        hvd.shutdown()


@pytest.mark.timeout(60)
def test_dynamic_process_sets_need_the_switch() -> None:
    assert all("HOROVOD_DYNAMIC_PROCESS_SETS=1" in r for r in phalanx.run(_no_dynamic_job, np=2))
