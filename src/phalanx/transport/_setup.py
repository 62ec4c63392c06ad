"""Build a group's shared-memory transport (collective: every rank of the job calls :func:`build`).

1. Every rank of the job allgathers (host key, shm usable) on the default group. The transport is used only
   when every rank has it enabled (``PHALANX_SHM`` not ``0``, ``/dev/shm`` writable): the choice must be
   the same everywhere.
2. Members on one host form a channel: the host's first member creates one segment with three regions
   (control blocks, data payloads, optimizer buckets), the names travel on the group's gloo control group,
   the others attach and check that they can see each other's processes (liveness), an allreduce (min) of
   the outcome decides for every member, and the creators unlink the names.
3. When the group spans hosts, its first member on each host joins a gloo *leaders* group (created on every
   rank of the job, as ``new_group`` requires): allreduce is reduce-in-host (shm), allreduce among
   leaders (gloo), share-in-host (shm). Other kinds then stay on gloo. When every host has as many members
   (``k``), ``k`` gloo *cross* groups join the members of each local index, one per host, so that a large
   allreduce crosses hosts part by part, every member carrying its part in parallel (``_hier``).
"""

from __future__ import annotations

import hashlib
import os
import platform
import socket
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from phalanx.env import names, settings
from phalanx.transport import _segment
from phalanx.transport._channel import Channel
from phalanx.transport._control import _pid_dead, layout
from phalanx.transport._serial import Serial

CTRL_SLOT_BYTES = 64 * 1024
NAME_BYTES = 128
KINDS = ("ctrl", "data", "grad")


@dataclass
class Transport:
    """A group's shared-memory channels.

    Attributes:
        channels: ``ctrl`` / ``data`` / ``grad`` channels of this host's members.
        leaders: the gloo group of each host's first member (None when the group is on one host).
        leader: whether this rank is its host's first member.
        ranks: the group's global ranks; local: those on this host, in order.
        hosts: the group's ranks of each host as indices into ``ranks``, hosts ordered by their first rank
            (the leaders' order); what :class:`~phalanx.transport._hier.Hierarchy` needs across hosts.
    """

    channels: dict[str, Channel]
    leaders: Any
    leader: bool
    ranks: tuple[int, ...]
    local: tuple[int, ...]
    seg: _segment.Segment | None
    wake_r: int = -1
    wake_w: list[int] = field(default_factory=list)
    grad_wake_r: int = -1  # the grad channel's own FIFOs: its waits run on the worker thread
    grad_wake_w: list[int] = field(default_factory=list)
    grad_async: bool = False  # PHALANX_SHM_GRAD_ASYNC: grad calls run on a worker thread (see grad_worker)
    worker: Serial | None = None
    hosts: tuple[tuple[int, ...], ...] = ()
    views: dict[str, Any] = field(default_factory=dict)  # this rank's Hierarchy per channel kind (_dispatch)
    cross: Any = None  # the gloo group of the members of this rank's local index, one per host (see build)

    @property
    def single_host(self) -> bool:
        """Whether every member is on this host (all kinds go through shared memory)."""
        return self.leaders is None

    def grad_worker(self) -> Serial | None:
        """The thread that runs the grad channel's calls asynchronously (single-host transports only: across
        hosts the leaders' gloo group is shared with the caller's thread, whose order must not interleave)."""
        if self.worker is None and self.grad_async and self.single_host and "grad" in self.channels:
            self.worker = Serial(f"phalanx shm grad ranks {list(self.local)}")
            # The wait hooks describe the caller's own wait: they run in the caller's thread, which
            # waits for the worker's calls with time-outs (``Pending.wait``), not in the worker's.
            self.channels["grad"].inspected = False
        return self.worker

    def abandon(self, cause: str) -> None:
        """Mark every channel given up by this rank (``Control.abort``): a peer blocked in one of them fails
        at its next check, naming ``cause``'s rank, instead of waiting out the channel's time-out."""
        for ch in self.channels.values():
            ch.abort(cause)

    def close(self) -> None:
        """Drop the channels and the mapping (after the grad worker finished its queued calls)."""
        worker, self.worker = self.worker, None
        timeout = max((ch.timeout_s for ch in self.channels.values()), default=0.0) + 1.0
        if worker is not None and not worker.close(timeout):
            return  # still inside a channel wait: leave the mapping to the process (names are unlinked)
        for ch in self.channels.values():
            ch.close()
        self.channels, self.views = {}, {}
        if self.seg is not None:
            self.seg.close()
        for fd in [self.wake_r, *self.wake_w, self.grad_wake_r, *self.grad_wake_w]:
            if fd >= 0:
                os.close(fd)
        self.wake_r, self.wake_w, self.grad_wake_r, self.grad_wake_w = -1, [], -1, []


#: Machines whose memory ordering the transport's lock-free counters are known correct on (docs/shm.md).
SUPPORTED_MACHINES = ("x86_64", "amd64")


def enabled() -> bool:
    """Whether this rank allows the transport (``PHALANX_SHM``, default on), runs on an x86-64 machine
    (elsewhere it turns itself off: its memory ordering is only known correct there) and has ``/dev/shm``."""
    on_x86 = platform.machine().lower() in SUPPORTED_MACHINES
    return settings.SHM.get() and on_x86 and _segment.available()


def slot_bytes() -> int:
    """Each rank's staging slot (``PHALANX_SHM_SLOT_BYTES``), a multiple of 64 bytes (at least 64)."""
    return settings.SHM_SLOT_BYTES.get() // 64 * 64 or 64


def _machine_id() -> str:
    """This machine's boot id and the identity of the /dev/shm it sees: ranks share a segment only when
    both match (two containers may share a hostname but not a /dev/shm; two machines, not a boot id)."""
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    try:
        st = os.stat(_segment.SHM_DIR)
        shm = f"{st.st_dev}:{st.st_ino}"
    except OSError:
        shm = ""
    return f"{boot}/{shm}"


def _host_key() -> int:
    host = settings.HOSTNAME.get() or socket.gethostname()
    key = f"{host}\0{_machine_id()}"
    return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=7).digest(), "little")


def _world_hosts() -> list[tuple[int, int]]:
    mine = torch.tensor([_host_key(), int(enabled())], dtype=torch.int64)
    out = torch.empty(2 * dist.get_world_size(), dtype=torch.int64)
    dist.all_gather_single(out, mine)
    rows = out.view(-1, 2).tolist()
    return [(int(h), int(ok)) for h, ok in rows]


def build(ranks: tuple[int, ...], ctrl: Any, timeout: timedelta | None = None) -> Transport | None:
    """Set up the transport of the group ``ranks`` (call on every rank of the job, in the same order);
    its cross-host groups get ``timeout`` (None: torch's default), as the caller's groups do.

    Returns:
        The transport on members whose group has at least two ranks on some host; None otherwise, and
        None everywhere when any rank disabled it or the setup failed on any member.
    """
    hosts = _world_hosts()
    if len(ranks) < 2 or not all(ok for _h, ok in hosts):
        return None
    by_host: dict[int, list[int]] = {}
    for r in ranks:
        by_host.setdefault(hosts[r][0], []).append(r)
    if all(len(v) == 1 for v in by_host.values()):
        return None
    firsts = sorted(v[0] for v in by_host.values())
    leaders = dist.new_group(firsts, backend="gloo", timeout=timeout) if len(firsts) > 1 else None
    crosses = [dist.new_group(list(c), backend="gloo", timeout=timeout)
               for c in cross_members(sorted(by_host.values()))]
    me = dist.get_rank()
    if me not in ranks:
        return None
    local = tuple(by_host[hosts[me][0]])
    transport = _attach_local(ranks, local, ctrl, leaders, timeout)
    if transport is not None:
        transport.hosts = tuple(tuple(ranks.index(r) for r in v) for v in sorted(by_host.values()))
        if crosses:
            transport.cross = crosses[local.index(me)]
    return transport


def cross_members(hosts: list[list[int]]) -> list[tuple[int, ...]]:
    """The members of each cross group: for each local index ``j``, every host's ``j``-th member, in host
    order (hosts ordered by their first member). None (``[]``) unless the group spans hosts with as many
    members on each, at least two, and host order is rank order in every cross group (as gloo ranks a
    group: reduce-scatters across hosts lay their blocks out in host order)."""
    k = len(hosts[0]) if hosts else 0
    if len(hosts) < 2 or k < 2 or any(len(h) != k for h in hosts):
        return []
    out = [tuple(h[j] for h in hosts) for j in range(k)]
    return out if all(list(c) == sorted(c) for c in out) else []


def _attach_local(ranks: tuple[int, ...], local: tuple[int, ...], ctrl: Any, leaders: Any,
                  timeout: timedelta | None) -> Transport | None:
    me = dist.get_rank()
    slot = slot_bytes()
    sizes = {"ctrl": CTRL_SLOT_BYTES, "data": slot, "grad": slot}
    total = sum(layout(len(local), s)[1] for s in sizes.values())
    transport = Transport({}, leaders, me == local[0], ranks, local, None, grad_async=grad_async())
    seg_name, fifo, gfifo, ok = "", "", "", True
    try:
        if len(local) > 1:
            if me == local[0]:
                transport.seg = _segment.create(total)
                seg_name = transport.seg.name
            fifo, transport.wake_r = _segment.make_fifo()
            gfifo, transport.grad_wake_r = _segment.make_fifo()
    except OSError:
        ok = False
    records = [r.split(";") for r in _exchange(ctrl, ranks, f"{seg_name};{fifo};{gfifo}")]
    try:
        if len(local) > 1 and ok:
            if transport.seg is None:
                transport.seg = _segment.attach(records[ranks.index(local[0])][0], total)
            transport.channels = _channels(transport.seg, local, sizes, timeout)
    except OSError:
        ok = False
    peers = [records[ranks.index(r)] for r in local]
    ok = _peers_visible(transport, ok, ctrl) and _wire_wakeups(transport, peers)
    agreed = torch.tensor([int(ok)], dtype=torch.int64)
    dist.all_reduce(agreed, op=dist.ReduceOp.MIN, group=ctrl)
    for name in (seg_name, fifo, gfifo):
        if name:
            _segment.unlink(name)
    if not int(agreed.item()):
        transport.close()
        return None
    _enable_cma(transport)
    return transport


def grad_async() -> bool:
    """Whether the optimizer's buckets run on the grad worker thread (``PHALANX_SHM_GRAD_ASYNC``, default off)."""
    return settings.SHM_GRAD_ASYNC.get()


def cma_wanted() -> bool:
    """Whether this rank allows cross-memory attach (``PHALANX_SHM_CMA``, default on)."""
    return settings.SHM_CMA.get()


def _enable_cma(transport: Transport) -> None:
    """Probe cross-memory attach once (collective among this host's members) and share it by the channels."""
    ctrl = transport.channels.get("ctrl")
    if ctrl is None:
        return
    ok = ctrl.enable_cma(cma_wanted())
    for ch in transport.channels.values():
        ch.cma = ok


def _wire_wakeups(transport: Transport, records: list[list[str]]) -> bool:
    """Open the local peers' FIFOs: one shared by the caller's channels (ctrl, data), one for grad's worker
    (two threads blocked on one FIFO could take each other's wake-ups)."""
    if not transport.channels:
        return True
    me = transport.local.index(dist.get_rank())
    try:
        transport.wake_w = [-1 if i == me else _segment.open_fifo(r[1]) for i, r in enumerate(records)]
        transport.grad_wake_w = [-1 if i == me else _segment.open_fifo(r[2]) for i, r in enumerate(records)]
    except (OSError, IndexError):
        return False
    for kind, ch in transport.channels.items():
        if kind == "grad":
            ch.set_wakeups(transport.grad_wake_r, transport.grad_wake_w)
        else:
            ch.set_wakeups(transport.wake_r, transport.wake_w)
    return True


def _exchange(ctrl: Any, ranks: tuple[int, ...], name: str) -> list[str]:
    raw = torch.zeros(NAME_BYTES, dtype=torch.uint8)
    data = name.encode()
    raw[: len(data)] = torch.tensor(list(data), dtype=torch.uint8)
    out = torch.empty(NAME_BYTES * len(ranks), dtype=torch.uint8)
    dist.all_gather_single(out, raw, group=ctrl)
    rows = out.view(len(ranks), NAME_BYTES).tolist()
    return [bytes(r).rstrip(b"\0").decode() for r in rows]


def _channels(seg: _segment.Segment, local: tuple[int, ...], sizes: dict[str, int],
              timeout: timedelta | None) -> dict[str, Channel]:
    """The group's channels; a wait gives up after the caller's group timeout when it set one (the user's
    ``HOROVOD_GLOO_TIMEOUT_SECONDS``), else after ``PHALANX_SHM_TIMEOUT_S``."""
    me = local.index(dist.get_rank())
    seconds, knob = settings.SHM_TIMEOUT.get(), names.PHALANX_SHM_TIMEOUT_S
    if timeout is not None:
        seconds, knob = timeout.total_seconds(), names.HOROVOD_GLOO_TIMEOUT_SECONDS
    label = f"ranks {list(local)}"
    channels, base = {}, 0
    for kind in KINDS:
        channels[kind] = Channel(seg, base, len(local), me, sizes[kind], seconds, f"{label} ({kind})", local,
                                 knob=knob)
        base += layout(len(local), sizes[kind])[1]
    return channels


def _peers_visible(transport: Transport, ok: bool, ctrl: Any) -> bool:
    """Whether every local peer's pid is visible here (it is not when ranks live in other pid namespaces)."""
    dist.barrier(group=ctrl)  # every member wrote its pid and made its FIFO (or failed before)
    if not ok or not transport.channels:
        return ok
    pids = transport.channels["ctrl"].peer_pids()
    return all(p and not _pid_dead(p) for p in pids)
