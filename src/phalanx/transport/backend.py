"""A ``torch.distributed`` backend, ``"phalanx_shm"``, for torch-native code (DDP, FSDP, Lightning).

``import phalanx.transport.backend`` registers it; then
``dist.init_process_group("phalanx_shm")`` (or ``backend="cpu:phalanx_shm"``) gives a process group that
answers allreduce, broadcast, barrier, all-gather-into-tensor and reduce-scatter-tensor of CPU tensors
through shared memory among the ranks of each host, and forwards every other call to a gloo process group
built on the same store. When the group spans hosts these calls are hierarchical (``_hier``): within the
host through shared memory, across hosts through a gloo group of each host's first rank (its leader), then
within the host again (large allreduces cross part by part, one gloo group per local index). Ranks
started by phalanx's worker entry get it in place of gloo without code changes
(``phalanx.worker.dist_backend``; ``PHALANX_SHM=0`` turns that off). See docs/shm.md.
"""

from __future__ import annotations

import collections
import os
import time
import weakref
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch._C import _distributed_c10d as _c10d

from phalanx.errors import ShmTransportError
from phalanx.transport import _check, _ops, _segment, _setup, native
from phalanx.transport._channel import Channel
from phalanx.transport._control import _pid_dead, layout
from phalanx.transport._hier import Hierarchy
from phalanx.transport._serial import Serial

NAME = native.BACKEND


class ShmProcessGroup(dist.ProcessGroup):
    """Shared memory for allreduce / broadcast / barrier / all-gather-into-tensor / reduce-scatter-tensor of
    contiguous CPU tensors (hierarchical when the group spans hosts); gloo for the rest."""

    def __init__(self, rank: int, size: int, gloo: Any, hier: Hierarchy | None) -> None:
        super().__init__(rank, size)  # type: ignore[call-arg]
        #: the wrapped gloo group (every other call) and the layout of the group's ranks on hosts (None: no
        #: host has two ranks of the group, or the transport is off: everything goes to gloo)
        self.gloo, self.hier = gloo, hier
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

    def _submit(self, sig: bytes, fn: Callable[[], None], result: list[torch.Tensor]) -> Any:
        """Queue ``fn`` after the check that every rank issued the same call (``_check``; gloo checks
        the same), so ranks that disagree raise on every rank instead of exchanging wrong data."""
        hier = self.hier
        assert hier is not None

        def checked() -> None:
            try:
                _check.check(sig, self.size(), hier.allgather_, f"{NAME} group of {self.size()} ranks")
            except ShmTransportError as e:  # name the call the user made, not the check's own exchange
                raise ShmTransportError(f"shared-memory {_check.KINDS[sig[0]]}: {e}") from e
            fn()

        return self.serial.submit(checked, result)

    def _fits(self, tensors: list[torch.Tensor]) -> bool:
        return self.hier is not None and len(tensors) == 1 and tensors[0].device.type == "cpu" and (
            tensors[0].is_contiguous())

    def allreduce(self, tensors: list[torch.Tensor], opts: Any = None) -> Any:  # type: ignore[override]
        """In-place allreduce (shared memory for one contiguous CPU tensor and a gloo op)."""
        op = opts.reduceOp if opts is not None else dist.ReduceOp.SUM
        if not isinstance(tensors, list):
            tensors = [tensors]
        if self._fits(tensors) and _ops.supports(op, tensors[0].dtype):
            hier, flat = self.hier, tensors[0].view(-1)
            assert hier is not None
            self.shm_calls["allreduce"] += 1
            sig = _check.signature("allreduce", flat.dtype, flat.numel(), op)
            return self._submit(sig, lambda: hier.allreduce_(flat, op), tensors)
        return self.gloo.allreduce(tensors, opts or dist.AllreduceOptions())

    def broadcast(self, tensors: list[torch.Tensor], opts: Any = None) -> Any:  # type: ignore[override]
        """Broadcast from ``opts.rootRank`` (a rank of this group)."""
        if not isinstance(tensors, list):
            tensors = [tensors]
        if self._fits(tensors) and opts is not None:
            hier, flat, root = self.hier, tensors[0].view(-1), opts.rootRank
            assert hier is not None
            data = flat.view(torch.uint8) if flat.numel() else flat
            self.shm_calls["broadcast"] += 1
            sig = _check.signature("broadcast", flat.dtype, flat.numel(), root=root)
            return self._submit(sig, lambda: hier.broadcast_(data, root), tensors)
        return self.gloo.broadcast(tensors, opts or dist.BroadcastOptions())

    def barrier(self, opts: Any = None) -> Any:
        """Return once every rank arrived."""
        if self.hier is not None:
            self.shm_calls["barrier"] += 1
            return self._submit(_check.signature("barrier"), self.hier.barrier, [])
        return self.gloo.barrier(opts or dist.BarrierOptions())

    def allgather(self, outputs: Any, inputs: Any, opts: Any = None) -> Any:
        """Forwarded to gloo."""
        return self.gloo.allgather(outputs, inputs, opts or _c10d.AllgatherOptions())

    def _flat_pair(self, output: Any, inp: Any) -> bool:
        """Both contiguous CPU tensors of one dtype, ``output`` ``size`` times ``inp``, neither empty."""
        return (self.hier is not None and isinstance(output, torch.Tensor) and isinstance(inp, torch.Tensor)
                and output.dtype == inp.dtype and self._fits([output]) and self._fits([inp])
                and inp.numel() > 0 and output.numel() == self.size() * inp.numel())

    def _allgather_base(self, output: Any, inp: Any, opts: Any = None) -> Any:
        """``dist.all_gather_into_tensor`` (FSDP's parameter all-gather): shared memory for CPU tensors."""
        if self._flat_pair(output, inp):
            hier, out, src = self.hier, output.view(-1).view(torch.uint8), inp.view(-1).view(torch.uint8)
            assert hier is not None
            self.shm_calls["allgather"] += 1
            sig = _check.signature("allgather", inp.dtype, inp.numel())
            return self._submit(sig, lambda: hier.allgather_(out, src), [output])
        return self.gloo._allgather_base(output, inp, opts or _c10d.AllgatherOptions())

    def all_gather_single(self, output: Any, inp: Any, opts: Any = None) -> Any:
        """Same as :meth:`_allgather_base` (the name newer torch versions call)."""
        return self._allgather_base(output, inp, opts)

    def _reduce_scatter_base(self, output: Any, inp: Any, opts: Any = None) -> Any:
        """``dist.reduce_scatter_tensor`` (FSDP's gradient reduce-scatter) of CPU tensors through shared memory
        (``Hierarchy.reduce_scatter_``: straight from the peers' inputs on one host, hierarchical across hosts);
        ops the transport does not reduce go to gloo."""
        op = opts.reduceOp if opts is not None else dist.ReduceOp.SUM
        if self._flat_pair(inp, output) and _ops.supports(op, inp.dtype):
            hier, src, dst = self.hier, inp.view(-1), output.view(-1)
            assert hier is not None
            path = hier.reduce_scatter_path(src, op)
            self.shm_calls["reduce_scatter"] += 1
            self.shm_calls[f"reduce_scatter_{path}"] += 1
            sig = _check.signature("reduce_scatter", inp.dtype, inp.numel(), op)
            return self._submit(sig, lambda: hier.reduce_scatter_(dst, src, op, path), [output])
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


def _hierarchy(store: Any, rank: int, size: int, timeout: timedelta) -> Hierarchy | None:
    """The group's layout on hosts (host keys via the store), with this host's channel and, on a leader of a
    multi-host group, the leaders' gloo group. None when the transport is off on any rank or no host has
    two ranks of the group (nothing to share: gloo carries everything)."""
    store.set(f"shm/host/{rank}", f"{_setup._host_key()}:{int(_setup.enabled())}")
    rows = [store.get(f"shm/host/{r}").decode().rsplit(":", 1) for r in range(size)]
    by_host: dict[str, list[int]] = {}
    for r, (host, _on) in enumerate(rows):
        by_host.setdefault(host, []).append(r)
    hosts = tuple(tuple(v) for v in by_host.values())  # ordered by first rank
    if size < 2 or any(on == "0" for _h, on in rows) or all(len(h) == 1 for h in hosts):
        return None
    mine = next(i for i, h in enumerate(hosts) if rank in h)
    local = hosts[mine]
    ch = _channel(store, f"shm/{mine}/", local, rank, timeout.total_seconds()) if len(local) > 1 else None
    if not _agreed(store, rank, size, ch is not None or len(local) == 1):
        if ch is not None:
            _drop(ch)
        return None
    if ch is not None:
        ch.enable_cma(_setup.cma_wanted())
    even, index = len({len(h) for h in hosts}) == 1, local.index(rank)
    cross = None  # this rank's gloo group across hosts: of its local index (hosts alike), else the leaders'
    if len(hosts) > 1 and (even or index == 0):
        cross = dist.ProcessGroupGloo(dist.PrefixStore(f"shm/cross/{index}", store), mine, len(hosts), timeout)
    leaders = cross if index == 0 else None
    return Hierarchy(ch, leaders, len(hosts) > 1, size, rank, hosts, cross if even else None)


def _agreed(store: Any, rank: int, size: int, ok: bool) -> bool:
    """Whether every rank of the group set up its host's channel (else none uses one: gloo for all)."""
    store.set(f"shm/ok/{rank}", str(int(ok)))
    return all(store.get(f"shm/ok/{r}") == b"1" for r in range(size))


def _channel(store: Any, prefix: str, local: tuple[int, ...], rank: int, timeout: float) -> Channel | None:
    """Map one segment for the group ranks ``local`` of this host (keys under ``prefix``; ``rank``: this one).

    ``timeout`` (seconds) is the group's (``init_process_group(timeout=...)``), as gloo's: every wait of the
    set-up and of every later collective on the channel gives up after it.

    None when this rank could not create / map it or open its peers' wake-up FIFOs, or cannot see every
    peer's process (ranks in other pid namespaces: the liveness checks would fail): ``_agreed`` then
    turns the transport off for the whole group rather than failing ``init_process_group``.
    """
    me, n = local.index(rank), len(local)
    slot = _setup.slot_bytes()
    total = layout(n, slot)[1]
    seg, channel, fifo, wake_r = None, None, "", -1
    try:
        seg = _segment.create(total) if me == 0 else None
    except OSError:
        seg = None
    if me == 0:
        store.set(f"{prefix}name", seg.name if seg is not None else "")
    name = store.get(f"{prefix}name").decode()  # rank 0 sets it, created or not
    try:
        seg = seg or (_segment.attach(name, total) if name else None)
        if seg is not None:
            label = f"{NAME} group, {n} ranks of this host (pid {os.getpid()})"
            channel = Channel(seg, 0, n, me, slot, timeout, label, local, knob="init_process_group(timeout=...)")
            fifo, wake_r = _segment.make_fifo()
    except OSError:
        channel = None
    store.set(f"{prefix}fifo/{me}", fifo)
    store.add(f"{prefix}attached", 1)
    try:
        _wait_count(store, f"{prefix}attached", n, timeout)
        names = [store.get(f"{prefix}fifo/{i}").decode() for i in range(n)]
        channel = _wire(channel, wake_r, me, names)
        store.add(f"{prefix}woken", 1)
        _wait_count(store, f"{prefix}woken", n, timeout)
    finally:  # every rank mapped the segment and opened the FIFOs (or gave up): the names can go
        if fifo:
            _segment.unlink(fifo)
        if me == 0 and name:
            _segment.unlink(name)
    if channel is not None and not all(p and not _pid_dead(p) for p in channel.peer_pids()):
        _drop(channel)
        return None
    return channel


def _wire(channel: Channel | None, wake_r: int, me: int, names: list[str]) -> Channel | None:
    """Open every peer's wake-up FIFO (all were made: every rank reached ``attached``); None on failure."""
    opened: list[int] = []
    if channel is not None and all(names):
        try:
            for i, nm in enumerate(names):
                opened.append(-1 if i == me else _segment.open_fifo(nm))
            channel.set_wakeups(wake_r, opened)
            return channel
        except OSError:
            pass
    _close_fds([wake_r, *opened])
    if channel is not None:
        _drop(channel)
    return None


def _drop(channel: Channel) -> None:
    """Close a channel that will not be used, its FIFOs and its mapping."""
    _close_fds([channel.wake_r, *channel.wake_w])
    channel.wake_r, channel.wake_w = -1, []
    channel.close()
    channel.seg.close()


def _wait_count(store: Any, key: str, n: int, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while int(store.add(key, 0)) < n:
        if time.monotonic() > deadline:
            raise TimeoutError(f"{NAME}: only {int(store.add(key, 0))} of {n} ranks reached {key!r} within "
                               f"{timeout_s:g} s (the group's timeout: init_process_group(timeout=...))")
        time.sleep(0.001)


def _create(store: Any, rank: int, size: int, timeout: timedelta) -> dist.ProcessGroup:
    gloo = dist.ProcessGroupGloo(dist.PrefixStore("gloo", store), rank, size, timeout)
    hier = _hierarchy(store, rank, size, timeout)
    pg = ShmProcessGroup(rank, size, gloo, hier)
    weakref.finalize(pg, pg.serial.close)
    if hier is not None and hier.ch is not None:  # the wake-up FIFOs go with the group
        weakref.finalize(pg, _close_fds, [hier.ch.wake_r, *hier.ch.wake_w])
    return pg


def _close_fds(fds: list[int]) -> None:
    for fd in fds:
        if fd >= 0:
            try:
                os.close(fd)
            except OSError:
                pass  # already closed


def pose_as_gloo(requested: str) -> None:
    """Make the default group, made for ``init_process_group(requested)`` with ``phalanx_shm`` in place of
    gloo on the CPU, look like the gloo group asked for: ``dist.get_backend()`` reports ``requested``, and
    every other device the request maps to gloo gets the wrapped gloo group as its backend (torch stops
    creating backends at a Python group, so it never made them). A group of another kind is left alone.

    Its device map (``dist.get_backend_config()``) keeps the truth, e.g. ``cpu:phalanx_shm,cuda:gloo``. A
    ``new_group`` without a backend inherits the name, so it is a plain gloo group.
    """
    c10d: Any = dist.distributed_c10d
    pg = c10d._get_default_group() if c10d.is_initialized() else None
    if not isinstance(pg, ShmProcessGroup):
        return
    for entry in str(c10d.get_backend_config(pg)).split(","):
        device, _, backend = entry.partition(":")
        if backend == "gloo":
            pg._register_backend(torch.device(device), dist.ProcessGroup.BackendType.GLOO, pg.gloo)
    _name, store = c10d._world.pg_map[pg]
    c10d._world.pg_map[pg] = (dist.Backend(requested), store)


if NAME not in dist.Backend.backend_list:
    dist.Backend.register_backend(NAME, _create, devices=["cpu"])
