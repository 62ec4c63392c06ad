"""Issue 32, item 2: ranks that disagree on a tensor's dtype raise on every rank, for every pair of torch
dtypes, through both mismatch checks (``phalanx_shm``'s under ``torch.distributed``; the hvd engine's).

The checks used to know twelve dtypes and give every other one code: uint16 against uint64 gathered
garbage, float8_e4m3fn broadcast into float8_e5m2 read 1.0 as 0.5, hvd.broadcast succeeded on one rank and
raised on the other. One job walks the whole matrix: first the diagonal (which dtypes each call moves at
all, the same on both ranks), then every pair of those that differ.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

import phalanx

pytestmark = [pytest.mark.multiprocess]

Call = Callable[[Any], object]


def _dtypes() -> list[Any]:
    """Every torch dtype but the quantized ones (a quantized tensor is not its bytes: it has no view)."""
    import torch

    return sorted({d for d in vars(torch).values() if isinstance(d, torch.dtype)
                   and not str(d).startswith("torch.q")}, key=str)


def _tensor(dtype: Any) -> Any:
    """Four elements of ``dtype``, made from bytes (many dtypes have no ``zeros``)."""
    import torch

    return torch.arange(4 * dtype.itemsize, dtype=torch.uint8).view(dtype)


def _walk(calls: dict[str, Call], rank: int) -> dict[str, Any]:
    """The diagonal (what each call moves: the root's bytes on every rank), then every differing pair."""
    import torch

    moved: dict[str, list[str]] = {}
    for api, call in calls.items():
        moved[api] = []
        for d in _dtypes():
            try:
                t = _tensor(d)
                got = call(t)
            except Exception:  # a dtype this call does not move at all (sub-byte, quantized): on every rank
                continue
            assert isinstance(got, torch.Tensor) and got.dtype == d
            moved[api].append(str(d))
    pairs: dict[str, str] = {}
    for api, call in calls.items():
        names = moved[api]
        for a in names:
            for b in names:
                if a != b:
                    mine = getattr(torch, (a if rank == 0 else b).removeprefix("torch."))
                    try:
                        call(_tensor(mine))
                        pairs[f"{api} {a} {b}"] = "no error"
                    except Exception as e:
                        pairs[f"{api} {a} {b}"] = type(e).__name__
    return {"moved": moved, "pairs": pairs}


def _matrix() -> dict[str, Any]:
    import warnings

    import torch
    import torch.distributed as dist

    import phalanx.torch as hvd

    warnings.simplefilter("ignore")  # experimental dtypes warn on creation
    dist.init_process_group("gloo")  # phalanx_shm stands in for gloo's CPU side
    backend = str(dist.get_backend_config())
    shm = _walk({
        "dist.broadcast": lambda t: (dist.broadcast(t, src=0), t)[1],
        "dist.all_gather_into_tensor": lambda t: _gather_into(dist, torch, t),
    }, dist.get_rank())
    dist.destroy_process_group()
    hvd.init()
    engine = _walk({
        "hvd.broadcast": lambda t: hvd.broadcast(t, root_rank=0),
        "hvd.allgather": lambda t: hvd.allgather(t),
    }, hvd.rank())
    return {"backend": backend, **{k: {**shm[k], **engine[k]} for k in ("moved", "pairs")}}


def _gather_into(dist: Any, torch: Any, t: Any) -> Any:
    out = torch.empty(2 * t.numel(), dtype=t.dtype)
    dist.all_gather_into_tensor(out, t)
    return out


@pytest.mark.timeout(300)
def test_every_pair_of_differing_dtypes_raises_on_every_rank() -> None:
    out = phalanx.run(_matrix, np=2)
    assert "phalanx_shm" in out[0]["backend"]
    assert out[0]["moved"] == out[1]["moved"]
    moved = out[0]["moved"]
    wanted = {"torch.uint16", "torch.uint64", "torch.float8_e4m3fn", "torch.float8_e5m2", "torch.float32",
              "torch.bfloat16", "torch.complex32"}
    for api, names in moved.items():  # the dtypes, and the common ones, are in every matrix
        assert wanted <= set(names), (api, wanted - set(names))
    for rank in (0, 1):
        passed = sorted(k for k, v in out[rank]["pairs"].items() if v != "CollectiveMismatchError")
        assert not passed, f"rank {rank}: {len(passed)} mismatches went through or raised otherwise: {passed[:10]}"
    assert len(out[0]["pairs"]) == sum(len(n) * (len(n) - 1) for n in moved.values())
