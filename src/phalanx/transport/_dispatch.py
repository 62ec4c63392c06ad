"""Routing of registered groups' calls (exported by ``api``): ``all_reduce`` / ``all_gather_single`` /
``broadcast`` with ``torch.distributed``'s signatures, carried by shared memory when the group has a
transport and the tensor qualifies (CPU, contiguous, a supported op), by ``torch.distributed`` otherwise.

Shared-memory work runs in the caller's thread and is complete when the call returns, except on a
``grad`` channel (gradient buckets), whose calls never block the caller: a call launched from a gradient
hook must not block backward waiting for a rank that has not produced that gradient yet (and is perhaps
itself waiting in an explicit collective). On a single-host transport they run
*asynchronously* on the transport's grad worker thread (``_serial``), in launch order, so a bucket is reduced
while backward goes on; across hosts they are *deferred* to ``wait()``, in launch order, in the caller's
thread (the leaders' gloo group is shared with the caller's other collectives, whose order a second thread
would break).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from phalanx.transport import _channel, _control, _early, _huge_pages, _many, _ops
from phalanx.transport._hier import Hierarchy
from phalanx.transport._setup import Transport

# id(torch group) -> (transport, channel kind); filled by ``register``, emptied by ``clear``.
_ROUTES: dict[int, tuple[Transport, str]] = {}
_DEFERRED: dict[int, deque[_Deferred]] = {}


class Done:
    """A completed work object (what ``torch.distributed`` returns, for work that already happened)."""

    def is_completed(self) -> bool:
        """Always True."""
        return True

    def wait(self, timeout: Any = None) -> bool:
        """Nothing to wait for."""
        return True


class _Deferred:
    """Work that runs on ``wait()``, after every earlier deferred work of the same channel."""

    def __init__(self, queue: deque[_Deferred], fn: Callable[[], None]) -> None:
        self.queue, self.fn, self.done = queue, fn, False
        self.error: BaseException | None = None
        queue.append(self)

    def is_completed(self) -> bool:
        return self.done

    def wait(self, timeout: Any = None) -> bool:
        """Run the queued work up to this one; raise its error, also on a later wait (as torch's ``Work``)."""
        _control.HOOKS.paused += 1  # the caller's wait hooks describe its own collectives, not queued grad work
        try:
            while not self.done:
                head = self.queue.popleft()
                head.done = True
                try:
                    head.fn()
                except BaseException as e:  # any: kept for a later wait() (a caller may wait twice on a failure)
                    head.error = e
                    raise
        finally:
            _control.HOOKS.paused -= 1
        if self.error is not None:
            raise self.error
        return True


def register(groups: dict[str, Any], transport: Transport) -> None:
    """Route the given torch groups (kind -> group) through ``transport``."""
    for kind, group in groups.items():
        _ROUTES[id(group)] = (transport, kind)


def abandon(cause: str) -> None:
    """Give up every registered transport's channels (a rank that leaves its collectives unfinished: the
    peers waiting in them fail at their next check); :func:`clear` still closes them."""
    for transport in {id(t): t for t, _kind in _ROUTES.values()}.values():
        transport.abandon(cause)


def clear() -> None:
    """Forget every route and close the transports (the caller's shutdown)."""
    for transport, _kind in list(_ROUTES.values()):
        transport.close()
    _ROUTES.clear()
    _DEFERRED.clear()


def _route(group: Any, t: torch.Tensor) -> tuple[Transport, str] | None:
    route = _ROUTES.get(id(group))
    if route is None or t.device.type != "cpu" or not t.is_contiguous():
        return None
    return route


def _finish(transport: Transport, kind: str, fn: Callable[[], None], inline: bool = False) -> Any:
    if kind != "grad":
        fn()
        return Done()
    worker = transport.grad_worker()
    if worker is not None:
        return worker.call(fn, inline)
    return _Deferred(_DEFERRED.setdefault(id(transport), deque()), fn)


def overlaps(group: Any) -> bool:
    """Whether an asynchronous ``all_reduce`` on ``group`` runs while the caller goes on (gloo / NCCL, and a
    single-host shared-memory ``grad`` channel), rather than deferred to ``wait()``."""
    route = _ROUTES.get(id(group))
    if route is None:
        return True
    transport, kind = route
    return kind == "grad" and transport.grad_worker() is not None


def all_reduce(t: torch.Tensor, op: Any = dist.ReduceOp.SUM, group: Any = None, async_op: bool = False,
               inline: bool = False) -> Any:
    """``dist.all_reduce`` (in place), through shared memory when the group has a transport.

    ``inline``: on a grad channel, run it in the thread that waits for it (after the calls issued before it)
    instead of on the worker thread (see ``_serial``).
    """
    route = _route(group, t)
    if route is None or not _ops.supports(op, t.dtype):
        return dist.all_reduce(t, op=op, group=group, async_op=async_op)
    transport, kind = route
    flat = t.view(-1) if t.dim() else t.reshape(1)

    def run() -> None:
        ch = transport.channels.get(kind)
        if ch is not None and kind == "grad" and transport.single_host and _grad_protocol(ch, flat, op):
            _many.allreduce_(ch, [flat], op)  # the grad channel's protocol (see all_reduce_many)
            return
        _hierarchy(transport, kind).allreduce_(flat, op)

    return _finish(transport, kind, run, inline)


def _hierarchy(transport: Transport, kind: str) -> Hierarchy:
    """This rank's view of the transport's group for ``kind``'s channel (see ``_hier``), built once."""
    view = transport.views.get(kind)
    if view is None:
        multi = transport.leaders is not None
        leaders = transport.leaders if multi and transport.leader else None
        me = transport.ranks.index(dist.get_rank())
        view = Hierarchy(transport.channels.get(kind), leaders, multi, len(transport.ranks), me, transport.hosts,
                         transport.cross)
        transport.views[kind] = view
    return view


def _grad_protocol(ch: _channel.Channel, flat: torch.Tensor, op: Any) -> bool:
    return _ops._kind(op) != dist.ReduceOp.AVG and _many.eligible(ch, flat.numel() * flat.element_size())


def all_reduce_many(tensors: list[torch.Tensor], group: Any, scale: float = 1.0, inline: bool = False,
                    nbytes: int = -1, start: int = 0) -> Any:
    """Sum the concatenation of ``tensors`` across ``group`` in place, straight from and into them (no
    fusion buffer), each rank's contribution multiplied by ``scale``; None when the group cannot (not a
    single-host shared-memory grad channel with cross-memory attach, or too small): the caller then fuses
    the tensors into one buffer and calls :func:`all_reduce`, which, on the grad channel, speaks the same
    protocol (so ranks that took different paths still meet).

    Args:
        tensors: flat contiguous CPU tensors of one floating dtype.
        group: the process set's grad group.
        scale: this rank's factor (Average's ``1/size``).
        inline: see :func:`all_reduce`.
        nbytes: their total size, when the caller knows it (-1: summed here).
        start: reduce only the bytes from this one on (the others were reduced early, see ``_early``).
    """
    route = _ROUTES.get(id(group))
    if route is None or route[1] != "grad" or not route[0].single_host:
        return None
    transport = route[0]
    ch = transport.channels.get("grad")
    if nbytes < 0:
        nbytes = sum(t.numel() * t.element_size() for t in tensors)
    if ch is None or not _many.eligible(ch, nbytes):
        return None
    _huge_pages.advise((t.data_ptr(), t.numel() * t.element_size()) for t in tensors)  # the peer reads them: huge pages
    return _finish(transport, "grad", lambda: _many.allreduce_(ch, tensors, dist.ReduceOp.SUM, scale, start), inline)


def _early_channel(group: Any) -> _channel.Channel | None:
    route = _ROUTES.get(id(group))
    if route is None or route[1] != "grad" or not route[0].single_host or route[0].grad_async:
        return None
    return route[0].channels.get("grad")


def early_claim(group: Any, key: tuple[int, int], sizes: list[int], fingerprint: int) -> _early.Area | None:
    """The early-reduction area of ``group``'s grad channel for the caller's ``key`` (see ``_early.claim``);
    None when the group has no such channel (or runs its buckets on the grad worker thread)."""
    return _early.claim(_early_channel(group), key, sizes, fingerprint)


def early_find(group: Any, key: tuple[int, int]) -> _early.Area | None:
    """The area ``key`` claimed on ``group`` (a rank that no longer contributes answers its steps), or None."""
    return _early.find(_early_channel(group), key)


def grad_barrier(group: Any) -> Any:
    """An empty step on ``group``'s grad channel after its queued calls (a bucket reduced early in full: the
    channel's step number still advances); returns its work."""
    transport = _ROUTES[id(group)][0]
    return _finish(transport, "grad", transport.channels["grad"].barrier)


def all_gather_single(out: torch.Tensor, inp: torch.Tensor, group: Any = None, async_op: bool = False) -> Any:
    """``dist.all_gather_single`` of equal-sized inputs: shared memory on a single-host group; across hosts
    hierarchical (shared memory in each host, gloo among the hosts' leaders: ``Hierarchy.allgather_``)."""
    route = _route(group, inp)
    if route is None or not out.is_contiguous():
        return dist.all_gather_single(out, inp, group=group, async_op=async_op)
    transport, kind = route
    return _finish(transport, kind, lambda: _hierarchy(transport, kind).allgather_(_bytes(out), _bytes(inp)))


def broadcast(t: torch.Tensor, src: int, group: Any = None, async_op: bool = False) -> Any:
    """``dist.broadcast`` from global rank ``src``: shared memory on a single-host group; across hosts
    hierarchical (within the root's host, among the leaders, within the other hosts)."""
    route = _route(group, t)
    if route is None:
        return dist.broadcast(t, src=src, group=group, async_op=async_op)
    transport, kind = route
    root = transport.ranks.index(src)
    return _finish(transport, kind, lambda: _hierarchy(transport, kind).broadcast_(_bytes(t), root))


def _bytes(t: torch.Tensor) -> torch.Tensor:
    flat = t.reshape(-1)
    return flat.view(torch.uint8) if flat.numel() else flat.to(torch.uint8)
