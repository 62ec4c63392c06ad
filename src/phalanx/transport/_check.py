"""What every rank of a ``phalanx_shm`` group checks before a shared-memory collective: that all ranks
issue the same one (kind, dtype, element count, reduce op, root), as gloo checks.

Without it, ranks that disagree read each other's slots as if they agreed: an allreduce of 4 against 6
elements returned ``[2, 2, 2, 2]`` on one rank and garbage past the fourth element on the other. Each
rank packs its call into 18 bytes (every dtype by its own code, :mod:`._dtypes`); the group all-gathers
them through the same transport and every rank compares the same gathered bytes, so every rank raises
the same :class:`CollectiveMismatchError`, or none does, before any data moves.
"""

from __future__ import annotations

import struct
from collections.abc import Callable

import torch
import torch.distributed as dist

from phalanx.errors import CollectiveMismatchError
from phalanx.transport._dtypes import dtype_code, dtype_name

_SIG = struct.Struct("<BBIiq")  # kind, op, dtype code, root, element count
KINDS = ("allreduce", "broadcast", "barrier", "allgather", "reduce_scatter")
_OPS = ("SUM", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR", "AVG", "PREMUL_SUM")


def _op_code(op: object) -> int:
    kind = getattr(op, "op", op)  # a ReduceOp object carries its RedOpType
    return next((i + 1 for i, name in enumerate(_OPS) if kind == getattr(dist.ReduceOp, name, None)), 255)


def signature(kind: str, dtype: torch.dtype | None = None, numel: int = 0, op: object = None,
              root: int = -1) -> bytes:
    """This rank's call, packed (18 bytes)."""
    code = 0 if dtype is None else dtype_code(dtype)
    return _SIG.pack(KINDS.index(kind), 0 if op is None else _op_code(op), code, root, numel)


def describe(sig: bytes) -> str:
    """A call as a person reads it: ``allreduce(float32[4], SUM)``."""
    kind, op, dtype, root, numel = _SIG.unpack(sig)
    parts = [f"{dtype_name(dtype)}[{numel}]"] if dtype else []
    parts += [_OPS[op - 1] if 0 < op <= len(_OPS) else "other op"] if op else []
    parts += [f"root {root}"] if root >= 0 else []
    return f"{KINDS[kind]}({', '.join(parts)})"


def check(sig: bytes, size: int, allgather: Callable[[torch.Tensor, torch.Tensor], None], label: str) -> None:
    """All-gather every rank's signature with ``allgather(out, inp)`` (flat uint8) and compare.

    Raises:
        CollectiveMismatchError: the ranks disagree (on every rank, with every rank's call).
    """
    mine = torch.frombuffer(bytearray(sig), dtype=torch.uint8)
    out = torch.empty(size * len(sig), dtype=torch.uint8)
    allgather(out, mine)
    raw = out.numpy().tobytes()
    sigs = [raw[i * len(sig):(i + 1) * len(sig)] for i in range(size)]
    if all(s == sigs[0] for s in sigs):
        return
    calls = "; ".join(f"rank {r}: {describe(s)}" for r, s in enumerate(sigs))
    raise CollectiveMismatchError(
        f"{label}: the ranks issued different collectives ({calls}); every rank must issue the same "
        "collective with the same dtype, element count, op and root, in the same order"
    )
