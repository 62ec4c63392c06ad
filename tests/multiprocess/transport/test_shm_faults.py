"""Faults: a peer killed mid-collective or stalled makes the survivor raise a clear error in bounded time;
nothing is left in /dev/shm after success, failure or SIGKILL of a rank."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch
import torch.distributed as dist

import phalanx
from phalanx.errors import ShmTransportError, WorkerFailedError

# white-box: faults injected below the public API, in segments and channels (no public name)
from phalanx.transport import _ops, _segment
from phalanx.transport._channel import Channel
from phalanx.transport._control import layout
from phalanx.transport._serial import Serial

pytestmark = [pytest.mark.multiprocess]

SLOT = 4096

PEER = textwrap.dedent(
    """
    import os, signal, sys, time, torch, torch.distributed as dist
    from phalanx.transport import _ops, _segment
    from phalanx.transport._channel import Channel
    from phalanx.transport._control import layout
    name, mode = sys.argv[1], sys.argv[2]
    seg = _segment.attach(name, layout(2, 4096)[1])
    ch = Channel(seg, 0, 2, 1, 4096, 60.0, "peer")
    _ops.allreduce_(ch, torch.ones(10), dist.ReduceOp.SUM)
    if mode == "kill":
        sys.stdin.read(1)  # the test has finished the first allreduce too: die before the next one
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(60)  # under test: a peer alive and silent ("hang"), until the test ends it
    """
)


def _leftovers() -> list[str]:
    return sorted(n for n in os.listdir("/dev/shm") if n.startswith(_segment.PREFIX))


def _pair(mode: str, timeout_s: float) -> tuple[Channel, subprocess.Popen[bytes]]:
    """A channel shared with a peer process that did one allreduce; then waits time out after ``timeout_s``."""
    seg = _segment.create(layout(2, SLOT)[1])
    peer = subprocess.Popen([sys.executable, "-c", PEER, seg.name, mode], stdin=subprocess.PIPE)
    ch = Channel(seg, 0, 2, 0, SLOT, 60.0, "test pair")  # the peer's start-up (importing torch) is slow
    t = torch.ones(10)
    _ops.allreduce_(ch, t, dist.ReduceOp.SUM)  # the peer attached: the name can go
    _segment.unlink(seg.name)
    assert torch.equal(t, torch.full((10,), 2.0))
    ch.timeout_s = timeout_s
    assert peer.stdin is not None
    peer.stdin.write(b"x")  # a killed peer dies now, between collectives, never inside the first one
    peer.stdin.close()
    return ch, peer


@pytest.mark.timeout(60)
def test_peer_killed_mid_collective_raises_promptly() -> None:
    ch, peer = _pair("kill", timeout_s=60.0)
    start = time.monotonic()
    with pytest.raises(ShmTransportError, match=r"has died"):
        _ops.allreduce_(ch, torch.ones(100_000), dist.ReduceOp.SUM)
    assert time.monotonic() - start < 10
    assert peer.wait(10) == -signal.SIGKILL
    with pytest.raises(ShmTransportError, match="cannot be used after a failure"):
        _ops.allreduce_(ch, torch.ones(3), dist.ReduceOp.SUM)
    assert _leftovers() == []


@pytest.mark.timeout(60)
def test_stalled_peer_hits_the_deadline() -> None:
    ch, peer = _pair("stall", timeout_s=1.0)
    start = time.monotonic()
    try:
        with pytest.raises(ShmTransportError, match=r"did not reach step .* PHALANX_SHM_TIMEOUT_S"):
            _ops.allreduce_(ch, torch.ones(10), dist.ReduceOp.SUM)
        assert time.monotonic() - start < 5
    finally:
        peer.kill()
        peer.wait(10)
    assert _leftovers() == []


@pytest.mark.timeout(60)
def test_peer_killed_during_a_worker_thread_allreduce_fails_its_waiter() -> None:
    """The grad worker thread (PHALANX_SHM_GRAD_ASYNC) hands a dead peer's error to the waiting caller."""
    ch, peer = _pair("kill", timeout_s=60.0)
    worker = Serial("test grad")
    pending = worker.call(lambda: _ops.allreduce_(ch, torch.ones(100_000), dist.ReduceOp.SUM))
    later = worker.call(lambda: _ops.allreduce_(ch, torch.ones(3), dist.ReduceOp.SUM), inline=True)
    start = time.monotonic()
    with pytest.raises(ShmTransportError, match=r"has died"):
        pending.wait()
    with pytest.raises(ShmTransportError, match="cannot be used after a failure"):
        later.wait()  # queued behind the failed call: fails at once instead of waiting again
    assert time.monotonic() - start < 10
    assert worker.close(timeout_s=5.0)
    assert peer.wait(10) == -signal.SIGKILL
    assert _leftovers() == []


def test_sweep_removes_segments_of_dead_creators() -> None:
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    path = os.path.join(_segment.SHM_DIR, f"{_segment.PREFIX}{dead.pid}-stale")
    with open(path, "wb") as f:
        f.write(b"x")
    _segment.sweep_stale()
    assert not os.path.exists(path)


def _die_mid_training(mode: str) -> None:
    import torch

    import phalanx.torch as hvd

    hvd.init()
    model = torch.nn.Linear(1000, 100)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters())
    for step in range(20):
        if step == 5 and hvd.rank() == 1:
            if mode == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            raise RuntimeError("rank 1 fails on purpose")
        opt.zero_grad()
        model(torch.randn(4, 1000)).sum().backward()
        opt.step()
        hvd.allreduce(torch.ones(70_000))


@pytest.mark.timeout(90)
@pytest.mark.parametrize(("mode", "grad_async"), [("kill", "0"), ("raise", "0"), ("kill", "1")])
def test_no_leak_when_a_rank_dies(mode: str, grad_async: str) -> None:
    env = {"PHALANX_SHM_SLOT_BYTES": "65536", "PHALANX_SHM_GRAD_ASYNC": grad_async}
    if grad_async == "1":  # two buckets: the survivor's worker thread waits in one when its peer is gone
        env["HOROVOD_FUSION_THRESHOLD"] = "100000"
    with pytest.raises(WorkerFailedError):
        phalanx.run(_die_mid_training, args=(mode,), np=2, env=env)
    assert _leftovers() == []
