"""Early gradient reduction (``phalanx/transport/_early.py``): the rank that finished backward first reduces the
gradients already final on both ranks while it waits. Checked against the single-process reference and, bit
for bit, against the plain allreduce; a lagging rank makes the early path run (full or partial) for sure."""

from __future__ import annotations

import os
import signal
import sys
import time
from typing import Any

import pytest

import phalanx
from phalanx.errors import WorkerFailedError

pytestmark = [pytest.mark.multiprocess]

WIDE = 256  # 68k parameters, 275 KB of gradients: reduced in place, more than one 128 KiB early piece
LAG_S = 0.06  # above _early.WAIT_S: the early worker gives up waiting for a gradient held this long


def _helpers() -> Any:
    sys.path.insert(0, os.path.dirname(__file__))
    import test_torch_optimizer as optimizer_tests

    return optimizer_tests


def _train(factory: Any, wrap: Any, me: int, lag: str, early: bool, bpps: int = 1) -> Any:
    """Train 3 steps on this rank's shard. ``lag``: rank 1 sleeps "after" backward (rank 0 reduces all early)
    or in the "hook" of the first layer's weight, the last gradient of the layout (rank 0 stops before it)."""
    import torch

    optimizer_tests = _helpers()
    model = optimizer_tests._model(width=WIDE)
    if lag == "hook" and me == 1:
        model[0].weight.register_post_accumulate_grad_hook(lambda p: time.sleep(LAG_S))  # the lag is the test
    opt = wrap(factory(model.parameters()), model)
    assert opt._early is not None, "the early area was not claimed"
    if not early:
        opt._early = None
    per = 4
    for x, y in optimizer_tests._batches(3, per * bpps, 2):
        xs, ys = x.view(2, per * bpps, 8)[me], y.view(2, per * bpps, 3)[me]
        for k in range(bpps):
            xk, yk = xs[k * per : (k + 1) * per], ys[k * per : (k + 1) * per]
            (torch.nn.functional.mse_loss(model(xk), yk) / bpps).backward()
        if lag == "after" and me == 1:
            time.sleep(LAG_S)  # the lag is the test: one rank late to step
        opt.step()
        opt.zero_grad()
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def _early_job() -> list[str]:
    import torch

    import phalanx.torch as hvd

    # white-box: the early-reduction area's counters and wait, internal (no public name)
    from phalanx.transport import _early

    hvd.init()
    me, fail, optimizer_tests = hvd.rank(), [], _helpers()
    total = sum(p.numel() * 4 for p in optimizer_tests._model(width=WIDE).parameters())
    avg = lambda o, m: hvd.DistributedOptimizer(o, named_parameters=m.named_parameters())  # noqa: E731
    for factory in (optimizer_tests._sgd, optimizer_tests._adam):
        want = optimizer_tests._reference(factory, 2, width=WIDE)
        for lag in ("after", "hook"):
            before = dict(_early.STATS)
            got = _train(factory, avg, me, lag, True)
            steps, done = _early.STATS["steps"] - before["steps"], _early.STATS["bytes"] - before["bytes"]
            # The lag makes rank 0 reduce early in every step on a quiet host; a loaded one may deschedule
            # rank 0 for longer than the lag, so a step may go the plain way: at least one must go early.
            if me == 0 and not (1 <= steps <= 3 and (done == steps * total if lag == "after"
                                                     else 0 < done < steps * total)):
                fail.append(f"{factory.__name__} lag {lag}: rank 0 reduced {done} bytes early in {steps} steps")
            if not torch.allclose(got, want, atol=1e-5, rtol=1e-5):
                fail.append(f"{factory.__name__} lag {lag}: max diff {float((got - want).abs().max())}")
            if not torch.equal(got, _train(factory, avg, me, lag, False)):
                fail.append(f"{factory.__name__} lag {lag}: not bit-identical to the plain allreduce")
    summed = lambda o, m: hvd.DistributedOptimizer(o, m.named_parameters(), op=hvd.Sum)  # noqa: E731
    for lag in ("after", "hook"):
        got = _train(optimizer_tests._sgd, summed, me, lag, True)
        agree, plain = hvd.broadcast(got, 0), _train(optimizer_tests._sgd, summed, me, lag, False)
        if not torch.equal(got, agree) or not torch.equal(got, plain):
            fail.append(f"op=Sum lag {lag}: ranks diverged or differ from the plain allreduce")
    bpps = lambda o, m: hvd.DistributedOptimizer(o, m.named_parameters(), backward_passes_per_step=2)  # noqa: E731
    got = _train(optimizer_tests._sgd, bpps, me, "after", True, bpps=2)
    want = optimizer_tests._reference(optimizer_tests._sgd, 2, bpps=2, width=WIDE)
    if not torch.allclose(got, want, atol=1e-5):
        fail.append(f"backward_passes_per_step=2: max diff {float((got - want).abs().max())}")
    optimizer_tests._check_unused_and_order(fail, me, width=WIDE)
    hvd.shutdown()
    return fail


@pytest.mark.timeout(180)
def test_early_reduction_matches_the_reference_and_the_plain_allreduce() -> None:
    assert phalanx.run(_early_job, np=2) == [[], []]


def _join_after_backward_job() -> dict[str, Any]:
    """Rank 1 runs one backward and joins without stepping (rank 0 reduces its marked gradients early, as
    Horovod's hooks would have submitted them); then rank 0 steps alone (rank 1 serves zeros)."""
    import torch
    import torch.distributed as dist

    import phalanx.torch as hvd

    # white-box: the early-reduction area's counters and wait, internal (no public name)
    from phalanx.transport import _early

    hvd.init()
    me, store = hvd.rank(), dist.distributed_c10d._get_default_store()
    torch.manual_seed(0)
    model = torch.nn.Linear(128, 160)
    w0 = [p.detach().clone() for p in model.parameters()]
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=1.0), model.named_parameters())
    grads = []
    for step in range(2 if me == 0 else 1):
        g = torch.Generator().manual_seed(10 * step + me)
        model(torch.randn(4, 128, generator=g)).sum().backward()
        grads.append([p.grad.clone() for p in model.parameters()])
        if me == 1:
            store.set("rank 1 marked", "1")
            break
        if step == 0:  # the worker gives up on a gradient not marked within WAIT_S: they must all be marked
            store.wait(["rank 1 marked"])
        opt.step()
        opt.zero_grad()
    last = hvd.join()
    final = [p.detach().clone() for p in model.parameters()]
    hvd.shutdown()
    return {"last": last, "w0": w0, "grads": grads, "final": final, "early": dict(_early.STATS)}


@pytest.mark.timeout(120)
def test_a_rank_that_joins_after_backward_serves_the_rest_of_an_early_step() -> None:
    r0, r1 = phalanx.run(_join_after_backward_job, np=2)
    assert r0["last"] == r1["last"] == 0
    assert r0["early"] == {"steps": 1, "bytes": (128 + 1) * 160 * 4}  # step 0, in full
    (g00, g01), (g10,) = r0["grads"], r1["grads"]
    for i, w in enumerate(r0["w0"]):  # step 0: (g0 + g1) / 2 (rank 1's marked gradient); step 1: g0 / 2
        want = w - (g00[i] + g10[i]) / 2 - g01[i] / 2
        assert (r0["final"][i] - want).abs().max() < 1e-5


def _peer_dies_job(how: str, lag: str) -> str:
    """Rank 1 leaves in the hook of its last gradient at step 2 (returns, or SIGKILLs itself); rank 0 has
    reduced early what rank 1 had marked, and must raise, not hang."""
    import torch

    import phalanx.torch as hvd
    from phalanx.errors import ShmTransportError

    # white-box: the early-reduction area's counters and wait, internal (no public name)
    from phalanx.transport import _early

    hvd.init()
    me, optimizer_tests = hvd.rank(), _helpers()
    model = optimizer_tests._model(width=WIDE)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters())
    state = {"step": 0}

    class Leave(Exception):
        pass

    def die(p: Any) -> None:
        if state["step"] == 2:
            time.sleep(float(lag))  # the peer dies this late into the step: the test's subject
            if how == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            raise Leave

    if me == 1:
        model[0].weight.register_post_accumulate_grad_hook(die)
    try:
        for step in range(5):
            state["step"] = step
            model(torch.ones(4, 8)).sum().backward()
            opt.step()
            opt.zero_grad()
    except Leave:
        return "left"  # without the step rank 0 is in
    except ShmTransportError as e:
        return f"ShmTransportError: {e} (reduced early: {_early.STATS})"
    return "finished"


@pytest.mark.timeout(90)
def test_a_peer_that_dies_while_reduced_early_makes_the_step_raise() -> None:
    out = phalanx.run(_peer_dies_job, args=("leave", "0.03"), np=2, env={"PHALANX_SHM_TIMEOUT_S": "20"})
    assert out[1] == "left"
    # the user's pending operation first, then the peer that left it
    assert out[0].startswith("ShmTransportError: optimizer step") and "peer rank 1" in out[0], out
    assert "died" in out[0] and "PHALANX_SHM=0" not in out[0], out
    assert "'steps': 0" not in out[0], out  # at least step 2's part: rank 1 sleeps before its last mark
    with pytest.raises(WorkerFailedError, match="SIGKILL"):
        phalanx.run(_peer_dies_job, args=("kill", "0.03"), np=2, env={"PHALANX_SHM_TIMEOUT_S": "20"})
    assert sorted(n for n in os.listdir("/dev/shm") if n.startswith("phalanx-shm-")) == []
