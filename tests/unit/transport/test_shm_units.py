"""The shared-memory transport's pieces without processes: segments, layout, reduce ops, the switch."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

from phalanx.env import settings

# white-box: segments, channels and ops, below the public transport API (no public name)
from phalanx.transport import _ops, _segment, _setup
from phalanx.transport._channel import Channel
from phalanx.transport._control import LINE, PAGE, layout


def test_segment_create_attach_unlink() -> None:
    seg = _segment.create(10_000)
    other = _segment.attach(seg.name, 10_000)
    seg.buf[:3] = b"abc"
    assert other.buf[:3] == b"abc"
    with pytest.raises(OSError, match="expected 20000"):
        _segment.attach(seg.name, 20_000)
    _segment.unlink(seg.name)
    _segment.unlink(seg.name)  # a second unlink is fine
    assert not os.path.exists(os.path.join(_segment.SHM_DIR, seg.name))
    assert other.buf[:3] == b"abc"  # the mapping outlives the name
    seg.close()
    other.close()


def test_layout_is_page_aligned() -> None:
    ctl, total = layout(3, 8192)
    assert ctl % PAGE == 0 and ctl >= 10 * LINE
    assert total == ctl + 3 * 8192


def test_single_rank_channel_reduces_nothing() -> None:
    seg = _segment.create(layout(1, 4096)[1])
    _segment.unlink(seg.name)
    ch = Channel(seg, 0, 1, 0, 4096, 5.0, "solo")
    t = torch.arange(5.0)
    _ops.allreduce_(ch, t, dist.ReduceOp.SUM)
    assert torch.equal(t, torch.arange(5.0))
    ch.barrier()
    ch.close()


@pytest.mark.parametrize(
    ("op", "dtype", "ok"),
    [
        (dist.ReduceOp.SUM, torch.float32, True),
        (dist.ReduceOp.BXOR, torch.int32, True),
        (dist.ReduceOp.MAX, torch.bool, True),
        (dist.ReduceOp.MIN, torch.complex64, False),
        (dist.ReduceOp.SUM, torch.complex64, True),
    ],
)
def test_supported_ops(op: object, dtype: torch.dtype, ok: bool) -> None:
    assert _ops.supports(op, dtype) is ok


def test_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PHALANX_SHM", "0")
    assert not _setup.enabled()
    monkeypatch.setenv("PHALANX_SHM", "1")
    assert _setup.enabled() is _segment.available()


def test_bad_knob_names_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PHALANX_SHM_TIMEOUT_S", "soon")
    with pytest.raises(ValueError, match="PHALANX_SHM_TIMEOUT_S='soon'"):
        settings.SHM_TIMEOUT.get()


def test_cma_reads_another_process_and_reports_errors() -> None:
    """``process_vm_readv`` from a child's memory; a bad address fails the probe; a dead pid raises ESRCH."""
    import errno

    # white-box: segments, channels and ops, below the public transport API (no public name)
    from phalanx.transport import _cross_memory

    if not _cross_memory.supported():
        pytest.skip("process_vm_readv needs Linux")
    src = torch.arange(1000, dtype=torch.int64)
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child keeps src (copy-on-write) at the same address until the parent is done
        os.close(w)
        os.read(r, 1)
        os._exit(0)
    os.close(r)
    try:
        dst = torch.zeros(1000, dtype=torch.int64)
        _cross_memory.read(pid, dst.data_ptr(), src.data_ptr(), 8000)
        assert torch.equal(dst, src)
        assert _cross_memory.probe(pid, src.data_ptr() + 8, (1).to_bytes(8, "little"))
        assert not _cross_memory.probe(pid, src.data_ptr(), (5).to_bytes(8, "little"))  # wrong content
        assert not _cross_memory.probe(pid, 8, b"12345678")  # unmapped address
    finally:
        os.write(w, b"x")
        os.close(w)
        os.waitpid(pid, 0)  # reaped: the pid names no process any more
    with pytest.raises(OSError) as info:
        _cross_memory.read(pid, dst.data_ptr(), src.data_ptr(), 8)
    assert info.value.errno == errno.ESRCH


def test_reduce_op_objects_are_recognised() -> None:
    """Process groups get ``AllreduceOptions.reduceOp`` as a ``ReduceOp`` object (DDP's buckets): it must
    select the same combiner as the ``RedOpType`` (it used to fall back to gloo silently)."""
    opts = dist.AllreduceOptions()
    for op, ok in ((dist.ReduceOp.SUM, True), (dist.ReduceOp.MAX, True)):
        opts.reduceOp = op
        assert _ops.supports(opts.reduceOp, torch.float32) is ok
    assert not _ops.supports(dist.ReduceOp.PREMUL_SUM, torch.float32)
    opts.reduceOp = dist.ReduceOp.AVG  # FSDP2's reduce-scatter: floating types only (sum, then divide)
    assert _ops.supports(opts.reduceOp, torch.float32) and not _ops.supports(opts.reduceOp, torch.int64)
    opts.reduceOp = dist.ReduceOp.SUM
    out = torch.empty(3)
    _ops._combiner(opts.reduceOp, torch.float32)(torch.ones(3), torch.full((3,), 2.0), out)
    assert out.tolist() == [3.0, 3.0, 3.0]


def test_cma_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PHALANX_SHM_CMA", raising=False)
    assert _setup.cma_wanted()
    monkeypatch.setenv("PHALANX_SHM_CMA", "off")
    assert not _setup.cma_wanted()


def test_auto_backend_choice() -> None:
    from phalanx.worker.dist_backend import choose

    one_host = {"WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"}  # on by default
    shm = "cpu:phalanx_shm,cuda:gloo"  # gloo's CUDA entry stays gloo's
    assert choose("gloo", {**one_host, "PHALANX_SHM_NATIVE": "1"}) == shm
    assert choose("gloo", one_host) == shm
    assert choose("GLOO", one_host) == shm
    assert choose("cpu:gloo,cuda:gloo", one_host) == shm
    assert choose("cuda:gloo,cpu:gloo", one_host) == shm
    assert choose("cpu:gloo", one_host) == "cpu:phalanx_shm"
    # a Python group cannot keep torch's NCCL backend beside it: such a request keeps gloo
    for other in ("nccl", None, "mpi", "cuda:nccl", "cpu:gloo,cuda:nccl", "cuda:gloo", "cpu:gloo,:gloo"):
        assert choose(other, one_host) == other
    assert choose("gloo", {**one_host, "WORLD_SIZE": "4"}) == "gloo"  # other hosts, their count unknown
    aabb = {"WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2", "GROUP_WORLD_SIZE": "2"}  # hierarchical
    assert choose("gloo", aabb) == shm
    assert choose("gloo", {**aabb, "LOCAL_WORLD_SIZE": "1"}) == shm  # AAAB: B's lone rank decides alike
    assert choose("gloo", {**aabb, "PHALANX_SHM": "0"}) == "gloo"
    assert choose("gloo", {**aabb, "GROUP_WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "1"}) == "gloo"  # one per host
    assert choose("gloo", {**aabb, "GROUP_WORLD_SIZE": "two"}) == "gloo"
    assert choose("gloo", {**one_host, "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1"}) == "gloo"
    assert choose("gloo", {**one_host, "PHALANX_SHM_NATIVE": "0"}) == "gloo"
    assert choose("gloo", {**one_host, "PHALANX_SHM_NATIVE": "off"}) == "gloo"
    assert choose("gloo", {**one_host, "PHALANX_SHM": "0"}) == "gloo"
    assert choose("gloo", {**one_host, "PHALANX_SHM_NATIVE": "1", "PHALANX_SHM": "false"}) == "gloo"
    assert choose("gloo", {**one_host, "WORLD_SIZE": "x"}) == "gloo"


def test_two_ranks_exchange_whole_tensors_up_to_a_larger_size() -> None:
    from types import SimpleNamespace

    # white-box: segments, channels and ops, below the public transport API (no public name)
    from phalanx.transport import _ops

    def limit(n: int, slot: int) -> int:
        return _ops.small_limit(SimpleNamespace(n=n, slot_bytes=slot))  # type: ignore[arg-type]

    assert limit(2, 2 << 20) == _ops.SMALL_BYTES_TWO_RANKS == 512 * 1024
    assert limit(3, 2 << 20) == limit(4, 2 << 20) == _ops.SMALL_BYTES
    assert limit(2, 4096) == 4096  # never beyond a slot
