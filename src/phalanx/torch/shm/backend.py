"""A ``torch.distributed`` backend, ``"phalanx_shm"``, for torch-native code (DDP, FSDP, Lightning).

``import phalanx.torch.shm.backend`` registers it; then
``dist.init_process_group("phalanx_shm")`` (or ``backend="cpu:phalanx_shm"``) gives a process group that
answers allreduce, broadcast and barrier of CPU tensors through shared memory when every rank of the group
is on this host, and forwards every other call (and everything on a multi-host group) to a gloo process
group built on the same store. Ranks started by phalanx's worker entry get it in place of gloo without
code changes (``phalanx.worker.dist_backend``; ``PHALANX_SHM=0`` turns that off). See docs/shm.md.
"""

from __future__ import annotations

import collections
import os
import time
import weakref
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch._C import _distributed_c10d as _c10d

from phalanx.torch.shm import _ops, _segment, _setup
from phalanx.torch.shm._channel import Channel, layout
from phalanx.torch.shm._serial import Serial

NAME = "phalanx_shm"


class ShmProcessGroup(dist.ProcessGroup):
    """Shared memory for allreduce / broadcast / barrier / all-gather-into-tensor / reduce-scatter-tensor of
    contiguous CPU tensors; gloo for the rest."""

    def __init__(self, rank: int, size: int, gloo: Any, channel: Channel | None) -> None:
        super().__init__(rank, size)  # type: ignore[call-arg]
        self.gloo, self.channel = gloo, channel
        # Calls a Python group cannot override (``dist.reduce``, ``monitored_barrier``, the dispatcher's ops)
        # look up the group's backend for the tensor's device: gloo answers them.
        self._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.GLOO, gloo)
        self.serial = Serial(f"{NAME} rank {rank}")
        #: calls carried by shared memory, by name ("allreduce", "broadcast", "barrier"); the rest went to gloo
        self.shm_calls: collections.Counter[str] = collections.Counter()

    def getBackendName(self) -> str:
        return NAME

    # A Python process group has no C++ backend to keep its name (DeviceMesh / FSDP2 read it): keep it here.
    def _set_group_name(self, name: str) -> None:
        self._phalanx_name = name

    @property
    def group_name(self) -> str:  # type: ignore[override]
        """The name torch.distributed gave this group (``_set_group_name``)."""
        return getattr(self, "_phalanx_name", "")

    def _fits(self, tensors: list[torch.Tensor]) -> bool:
        return self.channel is not None and len(tensors) == 1 and tensors[0].device.type == "cpu" and (
            tensors[0].is_contiguous())  # fmt: skip

    def allreduce(self, tensors: list[torch.Tensor], opts: Any = None) -> Any:  # type: ignore[override]
        """In-place allreduce (shared memory for one contiguous CPU tensor and a gloo op)."""
        op = opts.reduceOp if opts is not None else dist.ReduceOp.SUM
        if not isinstance(tensors, list):
            tensors = [tensors]
        if self._fits(tensors) and _ops.supports(op, tensors[0].dtype):
            ch, flat = self.channel, tensors[0].view(-1)
            assert ch is not None
            self.shm_calls["allreduce"] += 1
            return self.serial.submit(lambda: _ops.allreduce_(ch, flat, op), tensors)
        return self.gloo.allreduce(tensors, opts or dist.AllreduceOptions())

    def broadcast(self, tensors: list[torch.Tensor], opts: Any = None) -> Any:  # type: ignore[override]
        """Broadcast from ``opts.rootRank`` (a rank of this group)."""
        if not isinstance(tensors, list):
            tensors = [tensors]
        if self._fits(tensors) and opts is not None:
            ch, flat, root = self.channel, tensors[0].view(-1), opts.rootRank
            assert ch is not None
            data = flat.view(torch.uint8) if flat.numel() else flat
            self.shm_calls["broadcast"] += 1
            return self.serial.submit(lambda: _ops.broadcast_(ch, data, root), tensors)
        return self.gloo.broadcast(tensors, opts or dist.BroadcastOptions())

    def barrier(self, opts: Any = None) -> Any:
        """Return once every rank arrived."""
        if self.channel is not None:
            self.shm_calls["barrier"] += 1
            return self.serial.submit(self.channel.barrier, [])
        return self.gloo.barrier(opts or dist.BarrierOptions())

    def allgather(self, outputs: Any, inputs: Any, opts: Any = None) -> Any:
        """Forwarded to gloo."""
        return self.gloo.allgather(outputs, inputs, opts or _c10d.AllgatherOptions())

    def _flat_pair(self, output: Any, inp: Any) -> bool:
        """Both contiguous CPU tensors of one dtype, ``output`` ``size`` times ``inp``, neither empty."""
        return (self.channel is not None and isinstance(output, torch.Tensor) and isinstance(inp, torch.Tensor)
                and output.dtype == inp.dtype and self._fits([output]) and self._fits([inp])
                and inp.numel() > 0 and output.numel() == self.size() * inp.numel())  # fmt: skip

    def _allgather_base(self, output: Any, inp: Any, opts: Any = None) -> Any:
        """``dist.all_gather_into_tensor`` (FSDP's parameter all-gather): shared memory for CPU tensors."""
        if self._flat_pair(output, inp):
            ch, out, src = self.channel, output.view(-1).view(torch.uint8), inp.view(-1).view(torch.uint8)
            assert ch is not None
            self.shm_calls["allgather"] += 1
            return self.serial.submit(lambda: _ops.allgather_(ch, out, src), [output])
        return self.gloo._allgather_base(output, inp, opts or _c10d.AllgatherOptions())

    def all_gather_single(self, output: Any, inp: Any, opts: Any = None) -> Any:
        """Same as :meth:`_allgather_base` (the name newer torch versions call)."""
        return self._allgather_base(output, inp, opts)

    def _reduce_scatter_base(self, output: Any, inp: Any, opts: Any = None) -> Any:
        """``dist.reduce_scatter_tensor`` (FSDP's gradient reduce-scatter): for CPU tensors, a shared-memory
        allreduce of a copy of ``inp``, of which this rank keeps its part (twice a reduce-scatter's traffic,
        still well below gloo's time); ops the transport does not reduce go to gloo."""
        op = opts.reduceOp if opts is not None else dist.ReduceOp.SUM
        if self._flat_pair(inp, output) and _ops.supports(op, inp.dtype):
            ch, n, r = self.channel, output.numel(), self.rank()
            assert ch is not None
            src, dst = inp.view(-1), output.view(-1)

            def run() -> None:
                tmp = src.clone()
                _ops.allreduce_(ch, tmp, op)
                dst.copy_(tmp[r * n : (r + 1) * n])

            self.shm_calls["reduce_scatter"] += 1
            return self.serial.submit(run, [output])
        return self.gloo._reduce_scatter_base(output, inp, opts or dist.ReduceScatterOptions())

    def reduce_scatter_single(self, output: Any, inp: Any, opts: Any = None) -> Any:
        """Same as :meth:`_reduce_scatter_base` (the name newer torch versions call)."""
        return self._reduce_scatter_base(output, inp, opts)

    def all_to_all_single(self, *args: Any) -> Any:
        """Forwarded to gloo."""
        return self.gloo.alltoall_base(*args)

    def allreduce_coalesced(self, *args: Any) -> Any:
        """Forwarded to gloo."""
        return self.gloo.allreduce_coalesced(*args)

    def reduce_scatter(self, outputs: Any, inputs: Any, opts: Any = None) -> Any:  # type: ignore[override]
        """Forwarded to gloo."""
        return self.gloo.reduce_scatter(outputs, inputs, opts or dist.ReduceScatterOptions())

    def alltoall_base(self, *args: Any) -> Any:
        """Forwarded to gloo."""
        return self.gloo.alltoall_base(*args)

    def gather(self, *args: Any) -> Any:
        """Forwarded to gloo."""
        return self.gloo.gather(*args)

    def scatter(self, *args: Any) -> Any:
        """Forwarded to gloo."""
        return self.gloo.scatter(*args)

    def send(self, *args: Any) -> Any:
        """Forwarded to gloo."""
        return self.gloo.send(*args)

    def recv(self, *args: Any) -> Any:
        """Forwarded to gloo."""
        return self.gloo.recv(*args)


def _channel(store: Any, rank: int, size: int) -> Channel | None:
    """Every rank on this host and the transport enabled everywhere: map one segment (names via the store)."""
    store.set(f"shm/host/{rank}", f"{_setup._host_key()}:{int(_setup.enabled())}")
    hosts = {store.get(f"shm/host/{r}").decode() for r in range(size)}
    if size < 2 or len(hosts) != 1 or hosts.pop().endswith(":0"):
        return None
    slot = int(_setup._float_env("PHALANX_SHM_SLOT_BYTES", _setup.DEFAULT_SLOT_BYTES)) // 64 * 64 or 64
    total = layout(size, slot)[1]
    seg = _segment.create(total) if rank == 0 else None
    if seg is not None:
        store.set("shm/name", seg.name)
    seg = seg or _segment.attach(store.get("shm/name").decode(), total)
    timeout = _setup._float_env("PHALANX_SHM_TIMEOUT_S", _setup.DEFAULT_TIMEOUT_S)
    channel = Channel(seg, 0, size, rank, slot, timeout, f"{NAME} group of {size} (pid {os.getpid()})")
    fifo, wake_r = _segment.make_fifo()
    store.set(f"shm/fifo/{rank}", fifo)
    store.add("shm/attached", 1)
    try:
        _wait_count(store, "shm/attached", size, timeout)
        names = [store.get(f"shm/fifo/{r}").decode() for r in range(size)]
        channel.set_wakeups(wake_r, [-1 if r == rank else _segment.open_fifo(n) for r, n in enumerate(names)])
        store.add("shm/woken", 1)
        _wait_count(store, "shm/woken", size, timeout)
    finally:  # every rank mapped the segment and opened the FIFOs (or gave up): the names can go
        _segment.unlink(fifo)
        if rank == 0:
            _segment.unlink(seg.name)
    channel.enable_cma(_setup.cma_wanted())
    return channel


def _wait_count(store: Any, key: str, n: int, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while int(store.add(key, 0)) < n:
        if time.monotonic() > deadline:
            raise TimeoutError(f"{NAME}: only {int(store.add(key, 0))} of {n} ranks reached {key!r} within "
                               f"{timeout_s:g} s (PHALANX_SHM_TIMEOUT_S)")  # fmt: skip
        time.sleep(0.001)


def _create(store: Any, rank: int, size: int, timeout: timedelta) -> dist.ProcessGroup:
    gloo = dist.ProcessGroupGloo(dist.PrefixStore("gloo", store), rank, size, timeout)
    channel = _channel(store, rank, size)
    pg = ShmProcessGroup(rank, size, gloo, channel)
    weakref.finalize(pg, pg.serial.close)
    if channel is not None:  # the wake-up FIFOs go with the group
        weakref.finalize(pg, _close_fds, [channel.wake_r, *channel.wake_w])
    return pg


def _close_fds(fds: list[int]) -> None:
    for fd in fds:
        if fd >= 0:
            try:
                os.close(fd)
            except OSError:
                pass  # already closed


if NAME not in dist.Backend.backend_list:
    dist.Backend.register_backend(NAME, _create, devices=["cpu"])
