"""The control block every collective exchanges first: a signature, auxiliary words, an inline payload.

Every rank of a process set allgathers one fixed-size int64 block per collective on the set's gloo
control group. Because the block size depends only on the set's size, ranks that disagree on a shape never
send mismatched byte counts, so a mismatch is *detected* (on every rank, from the same gathered data)
instead of hanging. The block also carries:

* auxiliary words (one per member: the alltoall splits);
* the payload itself when it is small (``INLINE_BYTES``): such a collective finishes in one round trip,
  which is what keeps the check's latency cost near zero for small tensors.
"""

from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass

import torch

from phalanx.errors import CollectiveMismatchError
from phalanx.transport.api import dtype_code, dtype_name, dtype_of

MAGIC = 0x50484C58  # "PHLX"
MAX_DIMS = 8
NAME_WORDS = 16  # 128 bytes of UTF-8 name
HEADER_WORDS = 48
INLINE_BYTES = 8192
INLINE_WORDS = INLINE_BYTES // 8

# Word offsets in the header.
F_MAGIC, F_KIND, F_DTYPE, F_DEVICE, F_NDIM = 0, 1, 2, 3, 4
F_SHAPE = 5  # .. 5 + MAX_DIMS
F_NUMEL, F_OP, F_ROOT, F_PSET, F_PRE, F_POST, F_GHASH, F_COUNT, F_NBYTES = range(13, 22)
F_NAMELEN = 22
F_NAME = 23  # .. 23 + NAME_WORDS

KINDS = {1: "allreduce", 2: "allgather", 3: "broadcast", 4: "alltoall", 5: "reducescatter", 6: "barrier", 7: "join",
         8: "optimizer step", 9: "wait"}
WAIT = 9  # the kind code of a rank that only waits for pending named collectives (``_names``)

# Which fields each kind compares (beyond kind, device, process set, group signature and name).
_COMPARE: dict[str, tuple[str, ...]] = {
    "allreduce": ("dtype", "shape", "op", "prescale_factor", "postscale_factor"),
    "allgather": ("dtype", "trailing shape"),
    "broadcast": ("dtype", "shape", "root_rank"),
    "alltoall": ("dtype", "trailing shape"),
    "reducescatter": ("dtype", "shape", "op", "prescale_factor", "postscale_factor"),
    "barrier": (),
    "join": (),
    "optimizer step": ("optimizer",),  # root: the DistributedOptimizer's layout id (see _join)
    "wait": (),
}


@dataclass
class Signature:
    """What one rank says about a collective.

    Attributes:
        kind: one of ``KINDS`` values.
        name: the tensor name ('' when unnamed).
        dtype: the tensor dtype (grouped ops: of the first tensor); decoded from another rank whose torch
            has a dtype this one lacks, its name (``dtype #code``), which differs from every dtype here.
        device: 0 CPU, 1 CUDA.
        shape: the tensor shape (grouped ops: of the first tensor).
        op: reduce op code (-1 when not a reduction).
        root: root rank (-1 when not a broadcast).
        process_set_id: the set the collective runs on.
        prescale: prescale factor.
        postscale: postscale factor.
        group_hash: CRC of every (dtype, shape) of a grouped op; 0 for single tensors.
        count: number of tensors (grouped ops).
    """

    kind: str
    name: str
    dtype: torch.dtype | str
    device: int
    shape: tuple[int, ...]
    op: int = -1
    root: int = -1
    process_set_id: int = 0
    prescale: float = 1.0
    postscale: float = 1.0
    group_hash: int = 0
    count: int = 1


def group_hash(tensors: list[torch.Tensor]) -> int:
    """A stable (process-independent) hash of the dtypes and shapes of a grouped op's tensors."""
    text = ";".join(f"{t.dtype}{tuple(t.shape)}" for t in tensors)
    return zlib.crc32(text.encode())


def _fbits(x: float) -> int:
    return int(struct.unpack("<q", struct.pack("<d", float(x)))[0])


def _bitsf(x: int) -> float:
    return float(struct.unpack("<d", struct.pack("<q", int(x)))[0])


_CACHE_LIMIT = 512  # distinct signatures remembered by the encode / decode caches (a training loop has few)
_BLOCKS: dict[tuple[object, ...], torch.Tensor] = {}
_SIGS: dict[tuple[int, ...], Signature] = {}
_KIND_CODE = {v: k for k, v in KINDS.items()}


def _sig_key(sig: Signature) -> tuple[object, ...]:
    return (sig.kind, sig.name, sig.dtype, sig.device, sig.shape, sig.op, sig.root, sig.process_set_id,
            sig.prescale, sig.postscale, sig.group_hash, sig.count)


def encode(sig: Signature, aux: list[int], inline: torch.Tensor | None, n_aux: int,
           inline_words: int = INLINE_WORDS) -> torch.Tensor:
    """Build this rank's control block.

    The block of a signature without aux words and inline payload is cached (training loops repeat the
    same collectives): every call returns that same tensor, which callers must treat as read-only.
    Otherwise the cached block is cloned and the aux words and the payload are written into the copy.

    Args:
        sig: the signature.
        aux: up to ``n_aux`` auxiliary integers (alltoall splits).
        inline: the payload as a flat uint8 CPU tensor when it fits ``INLINE_BYTES``, else None.
        n_aux: auxiliary words in the block (the process set's size).
        inline_words: size of the inline area (every rank must use the same: 0 when a speculative payload
            is on its way, which every rank knows).

    Returns:
        An int64 tensor of ``HEADER_WORDS + n_aux + inline_words`` words.
    """
    nbytes = -1 if inline is None else int(inline.numel())
    key = (_sig_key(sig), nbytes, n_aux, inline_words)
    template = _BLOCKS.get(key)
    if template is None:
        if len(_BLOCKS) >= _CACHE_LIMIT:
            _BLOCKS.clear()
        template = _BLOCKS[key] = _template(sig, nbytes, n_aux, inline_words)
    if not aux and nbytes <= 0:
        return template
    block = template.clone()
    if aux:
        block[HEADER_WORDS : HEADER_WORDS + len(aux)] = torch.tensor(aux, dtype=torch.int64)
    if inline is not None and nbytes > 0:
        start = (HEADER_WORDS + n_aux) * 8
        block.view(torch.uint8)[start : start + nbytes].copy_(inline)
    return block


def _template(sig: Signature, nbytes: int, n_aux: int, inline_words: int) -> torch.Tensor:
    """The block of ``sig`` with zero aux words and a zero inline area (``nbytes`` in its header)."""
    words = [0] * HEADER_WORDS
    words[F_MAGIC], words[F_DEVICE], words[F_OP], words[F_ROOT] = MAGIC, sig.device, sig.op, sig.root
    words[F_KIND] = _KIND_CODE[sig.kind]
    words[F_DTYPE] = dtype_code(sig.dtype) if isinstance(sig.dtype, torch.dtype) else 0
    words[F_NDIM] = len(sig.shape)
    for i, d in enumerate(sig.shape[:MAX_DIMS]):
        words[F_SHAPE + i] = d
    words[F_NUMEL] = _numel(sig.shape)
    words[F_PSET], words[F_GHASH], words[F_COUNT] = sig.process_set_id, sig.group_hash, sig.count
    words[F_PRE], words[F_POST] = _fbits(sig.prescale), _fbits(sig.postscale)
    words[F_NBYTES] = nbytes
    raw = sig.name.encode()[: NAME_WORDS * 8]
    words[F_NAMELEN] = len(raw)
    padded = raw.ljust(NAME_WORDS * 8, b"\0")
    words[F_NAME : F_NAME + NAME_WORDS] = list(struct.unpack(f"<{NAME_WORDS}q", padded))
    block = torch.zeros(HEADER_WORDS + n_aux + inline_words, dtype=torch.int64)
    block[:HEADER_WORDS] = torch.tensor(words, dtype=torch.int64)
    return block


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def decode(words: list[int]) -> Signature:
    """Read a signature back from a header's words (the inverse of :func:`encode`, name truncated).

    Repeated headers return the same (cached) ``Signature`` object: callers must not modify it.
    """
    key = tuple(words)
    sig = _SIGS.get(key)
    if sig is None:
        if len(_SIGS) >= _CACHE_LIMIT:
            _SIGS.clear()
        sig = _SIGS[key] = _decode(words)
    return sig


def _decode(words: list[int]) -> Signature:
    ndim = words[F_NDIM]
    shape = tuple(words[F_SHAPE : F_SHAPE + min(ndim, MAX_DIMS)])
    raw = struct.pack(f"<{NAME_WORDS}q", *words[F_NAME : F_NAME + NAME_WORDS])[: words[F_NAMELEN]]
    code = words[F_DTYPE]
    return Signature(
        kind=KINDS.get(words[F_KIND], f"unknown({words[F_KIND]})"),
        name=raw.decode(errors="replace"),
        dtype=dtype_of(code) or dtype_name(code),
        device=words[F_DEVICE],
        shape=shape,
        op=words[F_OP],
        root=words[F_ROOT],
        process_set_id=words[F_PSET],
        prescale=_bitsf(words[F_PRE]),
        postscale=_bitsf(words[F_POST]),
        group_hash=words[F_GHASH],
        count=words[F_COUNT],
    )


def _field(sig: Signature, field: str) -> object:
    values: dict[str, object] = {
        "kind": sig.kind,
        "device": "cuda" if sig.device else "cpu",
        "process set": sig.process_set_id,
        "grouped tensors": (sig.count, sig.group_hash),
        "dtype": sig.dtype,
        "shape": sig.shape,
        "trailing shape": sig.shape[1:],
        "op": sig.op,
        "root_rank": sig.root,
        "optimizer": sig.root,
        "prescale_factor": sig.prescale,
        "postscale_factor": sig.postscale,
        "name": sig.name,
    }
    return values[field]


def find_mismatch(sigs: list[Signature], ranks: list[int]) -> str | None:
    """Compare every rank's signature; describe the first disagreeing field, or None when all agree.

    Args:
        sigs: the signatures in the order of ``ranks``.
        ranks: the global ranks of the process set.

    Returns:
        ``"shape: rank 0=(4,), rank 1=(5,)"``-style text, or None.
    """
    fields = ["kind", "device", "process set", "grouped tensors"]
    if sigs[0].kind == sigs[-1].kind:
        fields.extend(_COMPARE.get(sigs[0].kind, ()))
    if all(s.name for s in sigs):
        fields.append("name")
    for field in fields:
        seen = [_field(s, field) for s in sigs]
        if any(v != seen[0] for v in seen):
            values = ", ".join(f"rank {r}={v}" for r, v in zip(ranks, seen))
            return f"{field}: {values}"
    return None


def mismatch_error(sigs: list[Signature], ranks: list[int], detail: str, me: int) -> CollectiveMismatchError:
    """Build the error every rank raises for a mismatched collective.

    Args:
        sigs: every rank's signature.
        ranks: the global ranks in the order of ``sigs``.
        detail: the output of :func:`find_mismatch`.
        me: this rank's global rank.

    Returns:
        The error (the caller raises it).
    """
    mine = sigs[ranks.index(me)]
    names = sorted({s.name or "<unnamed>" for s in sigs})
    devices = ("; a group cannot mix CPU and CUDA tensors (NCCL carries CUDA tensors, gloo CPU ones): move the "
               "tensor to the same device on every rank") if detail.startswith("device:") else ""
    return CollectiveMismatchError(
        f"ranks disagree on collective {mine.kind} of tensor {' / '.join(repr(n) for n in names)} "
        f"(process set {mine.process_set_id}, ranks {ranks}): {detail}{devices}. Every rank of the process set "
        "must issue the same collectives in the same order with the same shape, dtype, op, root rank and "
        "process set; the collective was not run on any rank"
    )
