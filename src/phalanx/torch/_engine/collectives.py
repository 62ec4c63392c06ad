"""The kinds of collective: allreduce (single and grouped), allgather, broadcast, alltoall, reducescatter,
barrier. Each implements the one-round-trip inline path and the async payload path (``_engine``).

Non-arithmetic collectives move raw bytes (uint8 views), so every dtype works, bool and bfloat16 included.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist

from phalanx.torch._engine import header
from phalanx.torch._engine import reduce as reduction
from phalanx.torch._engine import speculate as speculation
from phalanx.torch._engine.collective import Collective
from phalanx.torch._runtime import RUNTIME
from phalanx.torch._setup import state as _state
from phalanx.torch.process_sets import _Groups
from phalanx.transport import api as shm


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of a contiguous tensor (a copy only when ``t`` is not contiguous)."""
    t = t.contiguous()
    if t.numel() == 0:  # an empty tensor may have zero strides, which a dtype view refuses
        return torch.empty(0, dtype=torch.uint8, device=t.device)
    if t.dim() == 0:
        t = t.reshape(1)
    return t.view(-1).view(torch.uint8)


def _device(t: torch.Tensor) -> int:
    return 1 if t.is_cuda else 0


def _from_bytes(raw: torch.Tensor, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    return raw.view(dtype).reshape(shape)


class Allreduce(Collective):
    """Allreduce of one or more tensors (grouped forms: one control block, one payload per tensor).

    Args:
        inputs: the tensors to reduce.
        outputs: where results go (the inputs themselves for in-place forms).
        op, prescale, postscale: Horovod's arguments.
        n: the process set's size.
        sig: the signature (kind ``allreduce``).
    """

    def __init__(
        self, inputs: list[torch.Tensor], outputs: list[torch.Tensor], op: int, prescale: float,
        postscale: float, n: int, sig: header.Signature,
    ) -> None:
        self.inputs, self.outputs, self.op, self.n, self.sig = inputs, outputs, op, n, sig
        self.post = postscale
        self.buffers = [reduction.prescale(t, prescale).reshape(-1) for t in inputs]
        self.works: list[Any] = []
        self.wire: list[torch.Tensor] = []
        self.scaled: list[bool] = []  # per wire: the final scaling was folded into the copy onto the wire
        self.pooled: torch.Tensor | None = None
        self.fold = _foldable(op, postscale, n, inputs[0].dtype if inputs else torch.uint8)
        self.spec_scaled = False

    def _copy_to_wire(self, buf: torch.Tensor, wire: torch.Tensor) -> bool:
        """Copy ``buf`` onto the wire; True when the final scaling was folded into the copy (one pass less)."""
        if self.fold is None or buf.dtype != wire.dtype:
            wire.copy_(buf)
            return False
        torch.mul(buf, self.fold, out=wire)
        return True

    def payload_bytes(self) -> torch.Tensor:
        parts = [as_bytes(b) for b in self.buffers]
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def run_inline(self, payloads: list[torch.Tensor], sigs: list[header.Signature], aux: list[list[int]]) -> None:
        offset = 0
        for buf, out in zip(self.buffers, self.outputs):
            nbytes = buf.numel() * buf.element_size()
            rows = [p[offset : offset + nbytes].view(buf.dtype) for p in payloads]
            offset += nbytes
            direct = out.is_contiguous() and out.dtype == buf.dtype and out.numel() == buf.numel()
            red = out.view(-1) if direct else torch.empty_like(buf)  # the rows are never views of ``out``
            _reduce_rows(rows, self.op, red)
            reduction.finish_scale(red, self.op, self.n, self.post)
            if not direct:
                out.copy_(red.reshape(out.shape))

    def speculative_buffer(self, key: tuple[Any, ...]) -> torch.Tensor:
        # ``buffers[0]`` is contiguous by construction (``reshape(-1)`` copies what is not).
        buf, out, src = self.buffers[0], self.outputs[0], self.inputs[0]
        if buf.data_ptr() != src.data_ptr() or out.data_ptr() == src.data_ptr():
            # A private (prescaled or reshaped) copy, or in place straight into the caller's tensor: a wrong
            # guess that no rank matched never used it, and a guess that some rank did not match is a
            # mismatch, which raises (the in-place tensor's contents are then undefined, as documented).
            return buf
        if out.is_contiguous():
            wire = out.view(-1)
            self.spec_scaled = self._copy_to_wire(buf, wire)
            return wire
        self.pooled = speculation.acquire(buf.numel(), buf.dtype)
        return self.pooled.copy_(buf)

    def adopt(self, buffer: torch.Tensor, work: Any) -> None:
        self.wire, self.works, self.scaled = [buffer], [work], [self.spec_scaled]

    def issue(self, groups: _Groups, sigs: list[header.Signature], aux: list[list[int]]) -> None:
        for buf, out in zip(self.buffers, self.outputs):
            wire_dt, scaled = reduction.wire_dtype(buf.dtype), False
            if wire_dt != buf.dtype:
                wire = buf.to(wire_dt)
            elif out.is_contiguous() and buf.data_ptr() != out.data_ptr() and out.numel() == buf.numel():
                wire = out.view(-1)
                scaled = self._copy_to_wire(buf, wire)
            else:
                wire = buf if buf.data_ptr() == out.data_ptr() else buf.clone()
            self.wire.append(wire)
            self.scaled.append(scaled)
            op = reduction.dist_op(self.op, buf.dtype)
            self.works.append(shm.all_reduce(wire, op=op, group=groups.data, async_op=True))

    def is_done(self) -> bool:
        return all(w.is_completed() for w in self.works)

    def pending(self) -> list[Any]:
        return list(self.works)

    def finish(self) -> Any:
        for work, wire, out, scaled in zip(self.works, self.wire, self.outputs, self.scaled):
            work.wait()
            result = wire.to(out.dtype) if wire.dtype != out.dtype else wire
            if not scaled:
                reduction.finish_scale(result, self.op, self.n, self.post)
            if result.data_ptr() != out.data_ptr():
                out.copy_(result.reshape(out.shape))
        if self.pooled is not None:
            speculation.release(self.pooled)
        return self.outputs[0] if self.sig.count == 1 and self.sig.group_hash == 0 else self.outputs


def _reduce_rows(rows: list[torch.Tensor], op: int, out: torch.Tensor) -> None:
    """Reduce every rank's row into ``out`` (flat, contiguous, the rows' dtype) in rank order: the same
    arithmetic as ``R.reduce_stack``, without stacking the rows first (sums, the common case)."""
    if len(rows) == 1:
        out.copy_(rows[0])
    elif op in (reduction.Average, reduction.Sum) and out.dtype != torch.bool:
        torch.add(rows[0], rows[1], out=out)
        for row in rows[2:]:
            out.add_(row)
    else:
        out.copy_(reduction.reduce_stack(torch.stack(rows), op))


def _foldable(op: int, postscale: float, n: int, dtype: torch.dtype) -> float | None:
    """The factor ``finish_scale`` would multiply a result by, when it may be applied to each rank's
    contribution instead (bit-identical: floating point and a power of two, so the scaling is exact and
    commutes with the sum), else None."""
    factor = postscale / (n if op == reduction.Average else 1)
    if not dtype.is_floating_point or factor == 1.0 or op not in (reduction.Average, reduction.Sum):
        return None
    mantissa, _ = math.frexp(factor)
    return factor if abs(mantissa) == 0.5 else None


class _OneWork(Collective):
    """A collective whose payload is one async work, ``self.work`` (None until issued or when inline)."""

    work: Any

    def is_done(self) -> bool:
        return bool(self.work.is_completed())

    def pending(self) -> list[Any]:
        return [] if self.work is None else [self.work]


class Allgather(_OneWork):
    """Allgather along dim 0; ranks may contribute different first dimensions."""

    def __init__(self, tensor: torch.Tensor, sig: header.Signature) -> None:
        self.tensor, self.sig = tensor.contiguous(), sig
        self.rest = tuple(tensor.shape[1:])
        self.work: Any = None
        self.buffer: torch.Tensor | None = None
        self.dims: list[int] = []

    def payload_bytes(self) -> torch.Tensor:
        return as_bytes(self.tensor)

    def _rows(self, raw: torch.Tensor, d0: int) -> torch.Tensor:
        return _from_bytes(raw, self.tensor.dtype, (d0, *self.rest))

    def run_inline(self, payloads: list[torch.Tensor], sigs: list[header.Signature], aux: list[list[int]]) -> None:
        self.result = torch.cat([self._rows(p, s.shape[0]) for p, s in zip(payloads, sigs)])

    def issue(self, groups: _Groups, sigs: list[header.Signature], aux: list[list[int]]) -> None:
        self.dims = [s.shape[0] for s in sigs]
        width = max(self.dims)
        mine = self.tensor
        if mine.shape[0] != width:
            mine = torch.zeros((width, *self.rest), dtype=mine.dtype, device=mine.device)
            mine[: self.tensor.shape[0]] = self.tensor
        self.buffer = torch.empty((len(self.dims) * width, *self.rest), dtype=mine.dtype, device=mine.device)
        self.work = shm.all_gather_single(as_bytes(self.buffer), as_bytes(mine), group=groups.data, async_op=True)

    def finish(self) -> Any:
        if self.work is None:
            return self.result
        self.work.wait()
        assert self.buffer is not None
        width = max(self.dims)
        if all(d == width for d in self.dims):
            return self.buffer
        return torch.cat([self.buffer[i * width : i * width + d] for i, d in enumerate(self.dims)])


class Broadcast(_OneWork):
    """Broadcast from ``root`` (a global rank) into ``output`` (the input itself for ``broadcast_``)."""

    def __init__(self, tensor: torch.Tensor, output: torch.Tensor, root: int, sig: header.Signature) -> None:
        self.tensor, self.output, self.root, self.sig = tensor, output, root, sig
        self.work: Any = None
        self.wire = output if output.is_contiguous() else output.contiguous()

    def payload_bytes(self) -> torch.Tensor:
        return as_bytes(self.tensor)

    def run_inline(self, payloads: list[torch.Tensor], sigs: list[header.Signature], aux: list[list[int]]) -> None:
        index = 0 if len(payloads) == 1 else self._root_index()
        self.output.copy_(_from_bytes(payloads[index], self.tensor.dtype, tuple(self.output.shape)))

    def _root_index(self) -> int:
        ranks = RUNTIME.registry.sets[self.sig.process_set_id].ranks
        return ranks.index(self.root)

    def issue(self, groups: _Groups, sigs: list[header.Signature], aux: list[list[int]]) -> None:
        if _state.topology().rank == self.root and self.wire.data_ptr() != self.tensor.data_ptr():
            self.wire.copy_(self.tensor)
        self.work = shm.broadcast(as_bytes(self.wire), src=self.root, group=groups.data, async_op=True)

    def finish(self) -> Any:
        if self.work is not None:
            self.work.wait()
            if self.wire.data_ptr() != self.output.data_ptr():
                self.output.copy_(self.wire)
        return self.output


class Alltoall(_OneWork):
    """Alltoall along dim 0 with per-destination row counts ``splits``; returns (output, received)."""

    def __init__(self, tensor: torch.Tensor, splits: list[int], me: int, sig: header.Signature) -> None:
        self.tensor, self.splits, self.me, self.sig = tensor.contiguous(), splits, me, sig
        self.rest = tuple(tensor.shape[1:])
        row = 1
        for d in self.rest:
            row *= d
        self.row_bytes = row * tensor.element_size()
        self.work: Any = None

    def aux(self) -> list[int]:
        return list(self.splits)

    def payload_bytes(self) -> torch.Tensor:
        return as_bytes(self.tensor)

    def _received(self, aux: list[list[int]]) -> list[int]:
        return [row[self.me] for row in aux]

    def run_inline(self, payloads: list[torch.Tensor], sigs: list[header.Signature], aux: list[list[int]]) -> None:
        parts = []
        for raw, sig, splits in zip(payloads, sigs, aux):
            rows = _from_bytes(raw, self.tensor.dtype, (sig.shape[0], *self.rest))
            start = sum(splits[: self.me])
            parts.append(rows[start : start + splits[self.me]])
        self.received = self._received(aux)
        self.output = torch.cat(parts)

    def issue(self, groups: _Groups, sigs: list[header.Signature], aux: list[list[int]]) -> None:
        self.received = self._received(aux)
        self.output = torch.empty(
            (sum(self.received), *self.rest), dtype=self.tensor.dtype, device=self.tensor.device
        )
        self.work = dist.all_to_all_single(
            as_bytes(self.output), as_bytes(self.tensor),
            output_split_sizes=[r * self.row_bytes for r in self.received],
            input_split_sizes=[s * self.row_bytes for s in self.splits],
            group=groups.data, async_op=True,
        )

    def finish(self) -> Any:
        if self.work is not None:
            self.work.wait()
        return self.output, torch.tensor(self.received, dtype=torch.int32)


class Reducescatter(Collective):
    """Reduce, then give rank i its slice of dim 0 (the first ``d0 % n`` ranks get one extra row)."""

    def __init__(self, tensor: torch.Tensor, op: int, pre: float, post: float, index: int, n: int,
                 sig: header.Signature) -> None:
        out = torch.empty_like(tensor)
        self.inner = Allreduce([tensor], [out], op, pre, post, n, sig)
        self.index, self.n, self.sig = index, n, sig
        self.result: torch.Tensor | None = None

    def payload_bytes(self) -> torch.Tensor:
        return self.inner.payload_bytes()

    def _slice(self, full: torch.Tensor) -> torch.Tensor:
        d0 = full.shape[0]
        base, extra = divmod(d0, self.n)
        start = self.index * base + min(self.index, extra)
        return full[start : start + base + (1 if self.index < extra else 0)].clone()

    def run_inline(self, payloads: list[torch.Tensor], sigs: list[header.Signature], aux: list[list[int]]) -> None:
        self.inner.run_inline(payloads, sigs, aux)
        self.result = self._slice(self.inner.outputs[0])

    def issue(self, groups: _Groups, sigs: list[header.Signature], aux: list[list[int]]) -> None:
        self.inner.issue(groups, sigs, aux)
        self.result = None

    def is_done(self) -> bool:
        return self.inner.is_done()

    def pending(self) -> list[Any]:
        return self.inner.pending()

    def finish(self) -> Any:
        if self.result is None:
            self.result = self._slice(self.inner.finish())
        return self.result


class Barrier(Collective):
    """A collective with no payload: returns once every member issued it."""

    def __init__(self, sig: header.Signature) -> None:
        self.sig = sig

    def payload_bytes(self) -> torch.Tensor:
        return torch.empty(0, dtype=torch.uint8)

    def run_inline(self, payloads: list[torch.Tensor], sigs: list[header.Signature], aux: list[list[int]]) -> None:
        return None

    def issue(self, groups: _Groups, sigs: list[header.Signature], aux: list[list[int]]) -> None:
        # Reached when a speculative allreduce was predicted instead (header-only block): nothing to send.
        self.run_inline([], sigs, aux)

    def finish(self) -> Any:
        return None
