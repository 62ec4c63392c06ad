"""Gradient buckets of the ``DistributedOptimizer``: a fixed layout, launched in a fixed order.

Every rank builds the same layout from the same parameter order (reverse registration order, as DDP:
the last layers' gradients are ready first). Bucket ``i`` is launched only after buckets ``0..i-1``, so
the allreduce order on the data group is identical on every rank whatever order the gradient hooks fire
in; a bucket whose parameter got no gradient on some rank is launched by ``synchronize`` (with zeros).

When the gradient group is a single-host shared-memory channel with cross-memory attach, a bucket is
reduced *directly*: straight from the gradient tensors autograd produced and into them
(``GradChannel.all_reduce_many``), with no fusion buffer and no copy; the Average division is applied by each
part's owner after the sum.
Otherwise (or when a gradient is sparse or not contiguous on this rank) each parameter's ``.grad`` becomes a
view into its bucket's flat buffer, so the reduced gradient needs no copy back; the Average division is folded
into the copy in (``mul(out=)``). Both paths speak the same protocol on the grad channel, so ranks that took
different paths still meet.

On a grad channel of two ranks on one host, the first bucket may be partly reduced before its allreduce:
the hooks mark its gradients final (``mark_early``) and, in ``synchronize``, the rank that arrives first
reduces the marked ones while it waits for the other (``launch_early``, ``transport/_early.py``); the allreduce then
covers only the rest.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass, field
from typing import Any

import torch

from phalanx.torch._health import stall as _stall
from phalanx.torch.compression import Compression, Compressor
from phalanx.transport.api import EarlyArea, GradChannel


@dataclass
class Bucket:
    """Parameters whose gradients are reduced together.

    Attributes:
        params: the parameters, in layout order.
        buffer: the flat gradient buffer (``dtype``/``device`` of the parameters).
        offsets: start of each parameter in ``buffer``.
        pending: parameters whose gradient is not yet final in this step.
    """

    params: list[torch.Tensor]
    buffer: torch.Tensor
    offsets: list[int]
    pending: set[int] = field(default_factory=set)
    work: Any = None
    wire: torch.Tensor | None = None
    ctx: Any = None
    direct: list[torch.Tensor] | None = None  # the gradients reduced in place (see ``launch_direct``)

    def reset(self) -> None:
        """Mark every parameter pending (start of a step)."""
        self.pending = {id(p) for p in self.params}
        self.work, self.wire, self.ctx, self.direct = None, None, None, None

    def view(self, i: int) -> torch.Tensor:
        """The slice of ``buffer`` that holds parameter ``i``'s gradient, shaped like it."""
        p = self.params[i]
        return self.buffer[self.offsets[i] : self.offsets[i] + p.numel()].view_as(p)


def plan(params: list[torch.Tensor], threshold_bytes: int, groups: list[list[torch.Tensor]] | None) -> list[Bucket]:
    """Lay out buckets.

    Args:
        params: the parameters that need gradients, in registration order.
        threshold_bytes: maximum bytes per bucket (a larger single parameter gets its own bucket).
        groups: explicit groups (each becomes one bucket per dtype); ``None`` to fuse by threshold.

    Returns:
        Buckets in launch order.
    """
    if groups is None:
        chunks: list[list[torch.Tensor]] = []
        size = 0
        for p in reversed(params):
            nbytes = p.numel() * p.element_size()
            last = chunks[-1] if chunks else None
            same_kind = last is not None and (last[0].dtype, last[0].device) == (p.dtype, p.device)
            if not same_kind or size + nbytes > threshold_bytes:
                chunks.append([])
                size = 0
            chunks[-1].append(p)
            size += nbytes
    else:
        chunks = []
        for group in groups:
            by_kind: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
            for p in group:
                by_kind.setdefault((p.dtype, p.device), []).append(p)
            chunks.extend(by_kind.values())
    return [_bucket(c) for c in chunks if c]


def _bucket(params: list[torch.Tensor]) -> Bucket:
    offsets, total = [], 0
    for p in params:
        offsets.append(total)
        total += p.numel()
    buffer = torch.zeros(total, dtype=params[0].dtype, device=params[0].device)
    bucket = Bucket(params=params, buffer=buffer, offsets=offsets)
    bucket.reset()
    return bucket


def pack(bucket: Bucket, prescale: float) -> None:
    """Move every parameter's gradient into the bucket (scaled), and make ``.grad`` a view of it.

    A gradient that already is the view (accumulated in place since the last step) is scaled in place.
    """
    for i, p in enumerate(bucket.params):
        seg = bucket.view(i)
        grad = p.grad
        if grad is not None and not grad.is_sparse and grad.data_ptr() == seg.data_ptr() and grad.shape == seg.shape:
            if prescale != 1.0:
                seg.mul_(prescale)
            continue
        if grad is None:
            seg.zero_()
        elif prescale != 1.0:
            torch.mul(grad.to_dense() if grad.is_sparse else grad, prescale, out=seg)
        else:
            seg.copy_(grad.to_dense() if grad.is_sparse else grad)
        p.grad = seg


DIRECT_DTYPES = (torch.float32, torch.float64)  # the owner scales after the sum: no predivide numerics needed


def _direct_grads(bucket: Bucket) -> list[torch.Tensor] | None:
    """Every parameter's gradient as a flat contiguous tensor (zeros for a parameter without one), or None
    when one cannot be reduced in place (sparse, strided, another dtype or device)."""
    dtype = bucket.buffer.dtype
    if dtype not in DIRECT_DTYPES or bucket.buffer.device.type != "cpu":
        return None
    grads = []
    for p in bucket.params:
        g = p.grad
        if g is None:
            g = p.grad = torch.zeros_like(p, memory_format=torch.contiguous_format)
        if g.is_sparse or not g.is_cpu or g.dtype != dtype or not g.is_contiguous():
            return None
        grads.append(g.view(-1))
    return grads


def launch_direct(bucket: Bucket, compression: type[Compressor], grad: GradChannel, prescale: float,
                  inline: bool) -> bool:
    """Start the bucket's allreduce straight from its gradients when the group allows it (see the module).

    Returns:
        False when it did not start (then :func:`pack` and :func:`launch` it).
    """
    if compression is not Compression.none:
        return False
    grads = _direct_grads(bucket)
    if grads is None:
        return False
    nbytes = bucket.buffer.numel() * bucket.buffer.element_size()
    work = grad.all_reduce_many(grads, prescale, inline, nbytes)
    if work is None:
        return False
    bucket.work, bucket.direct = work, grads
    return True


def _eligible(g: torch.Tensor, dtype: torch.dtype) -> bool:
    return not g.is_sparse and g.is_cpu and g.dtype == dtype and g.is_contiguous()


def early_area(buckets: list[Bucket], compression: type[Compressor], grad: GradChannel,
               key: tuple[int, int]) -> EarlyArea | None:
    """The grad channel's early-reduction area for the first bucket (``transport._early``), or None when it does not
    apply (compression, a dtype or device the direct path does not reduce, a channel that cannot)."""
    if compression is not Compression.none or not buckets:
        return None
    first = buckets[0].buffer
    if first.dtype not in DIRECT_DTYPES or first.device.type != "cpu":
        return None
    sizes = [p.numel() * p.element_size() for p in buckets[0].params]
    fingerprint = zlib.crc32(repr((sizes, str(first.dtype), len(buckets))).encode())
    return grad.early_claim(key, sizes, fingerprint)


def mark_early(area: Any, bucket: Bucket, i: int, scale: float) -> None:
    """Tell the early area that parameter ``i`` of the first bucket has its final gradient (if reducible in
    place: dense, contiguous, the bucket's dtype, on the CPU)."""
    g = bucket.params[i].grad
    if g is not None and _eligible(g, bucket.buffer.dtype):
        area.mark(i, g, scale)


def launch_early(bucket: Bucket, area: Any, grad: GradChannel, prescale: float) -> bool:
    """Agree with the peer on the bytes of the first bucket reduced early (``transport._early``) and start the
    allreduce of the rest, straight from the gradients (zeros for a missing one; a gradient that cannot be
    reduced in place is copied into the bucket's buffer).

    Returns:
        False when nothing was reduced early (then launch the bucket as usual).
    """
    grads = _direct_grads(bucket)
    k = area.agree(grads, prescale)
    if k == 0:
        return False
    if grads is None or (not area.worked and _restore(bucket, area.kept, k)):
        grads = _mixed_grads(bucket)
    nbytes = bucket.buffer.numel() * bucket.buffer.element_size()
    bucket.direct = grads
    if k >= nbytes:
        bucket.work = grad.barrier()
    else:
        bucket.work = grad.all_reduce_many(grads, prescale, True, nbytes, start=k)
    return True


def _restore(bucket: Bucket, kept: list[torch.Tensor | None], k: int) -> bool:
    """Give back the marked gradients the peer reduced early where ``.grad`` was replaced since its hook (the
    gradient as of the hook is the one reduced, as in Horovod); whether any was."""
    changed, start = False, 0
    for p, mark in zip(bucket.params, kept):
        if start >= k:
            break
        if mark is not None and p.grad is not mark:
            p.grad, changed = mark, True
        start += p.numel() * p.element_size()
    return changed


def _mixed_grads(bucket: Bucket) -> list[torch.Tensor]:
    """Every gradient as a flat tensor reduced in place: zeros for a missing one, and the bucket's slice for
    one that cannot be (then ``.grad`` becomes that slice)."""
    dtype, grads = bucket.buffer.dtype, []
    for i, p in enumerate(bucket.params):
        g = p.grad
        if g is None:
            g = p.grad = torch.zeros_like(p, memory_format=torch.contiguous_format)
        elif not _eligible(g, dtype):
            seg = bucket.view(i)
            seg.copy_(g.to_dense() if g.is_sparse else g)
            g = p.grad = seg
        grads.append(g.view(-1))
    return grads


def launch(bucket: Bucket, compression: type[Compressor], grad: GradChannel, inline: bool = False) -> None:
    """Start the bucket's asynchronous allreduce (sum) on ``grad`` (``inline``: see ``GradChannel.all_reduce``)."""
    wire, bucket.ctx = compression.compress(bucket.buffer)
    bucket.wire = wire
    bucket.work = grad.all_reduce(wire, inline=inline)


def wait(bucket: Bucket, compression: type[Compressor], postscale: float) -> None:
    """Wait for the bucket's allreduce and leave the reduced gradient in ``buffer`` (hence in ``.grad``), or
    in the gradients themselves when it was launched directly."""
    if bucket.direct is not None:
        _stall.wait(bucket.work)
        if postscale != 1.0:
            for g in bucket.direct:
                g.mul_(postscale)
        return
    assert bucket.wire is not None
    if bucket.wire.is_cuda:
        bucket.work.wait()
    else:  # a stall is reported as the step's announcement block (the engine entry submitted just before)
        _stall.wait(bucket.work)
    if bucket.wire.data_ptr() != bucket.buffer.data_ptr():
        bucket.buffer.copy_(compression.decompress(bucket.wire, bucket.ctx))
    if postscale != 1.0:
        bucket.buffer.mul_(postscale)
