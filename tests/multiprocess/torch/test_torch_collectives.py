"""phalanx.torch collectives on real gloo ranks: every op over dtypes x 1-3 dims x inline/payload sizes.

Each test is ONE ``phalanx.run`` job that runs many checks and returns the list of failures (a job costs
~3 s of interpreter start-up).
"""

from __future__ import annotations

import itertools
from typing import Any

import pytest

import phalanx

pytestmark = [pytest.mark.multiprocess]

# (small: travels inline in the control block, large: goes through the payload collective)
SHAPES = {1: [(5,), (9000,)], 2: [(5, 4), (90, 100)], 3: [(5, 4, 3), (9, 10, 100)]}


def _dtypes() -> list[Any]:
    import torch

    return [torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.float16, torch.bfloat16,
            torch.float32, torch.float64, torch.bool]


def _gen(rank: int, dtype: Any, shape: tuple[int, ...], salt: int = 0) -> Any:
    """Small integer values (exact in every dtype, products stay small)."""
    import torch

    g = torch.Generator().manual_seed(1000 * rank + salt)
    vals = torch.randint(1, 3, shape, generator=g)
    return (vals > 1) if dtype == torch.bool else vals.to(dtype)


def _expected(tensors: list[Any], op: int) -> Any:
    import torch

    import phalanx.torch as hvd

    stack = torch.stack([t.double() for t in tensors])
    if tensors[0].dtype == torch.bool:
        return (stack.amax(0) if op in (hvd.Sum, hvd.Max) else stack.amin(0)).bool()
    red = {hvd.Sum: stack.sum(0), hvd.Average: stack.sum(0) / len(tensors), hvd.Min: stack.amin(0),
           hvd.Max: stack.amax(0), hvd.Product: stack.prod(0)}[op]
    return red.to(tensors[0].dtype)


def _same(got: Any, want: Any) -> bool:
    """Exact, except floating-point results (Average divides by 3, inexact) within a relative 1e-2."""
    import torch

    if got.dtype != want.dtype or got.shape != want.shape:
        return False
    if want.dtype.is_floating_point:
        return torch.allclose(got.double(), want.double(), rtol=1e-2, atol=0)
    return torch.equal(got, want)


def _ops_for(dtype: Any) -> list[int]:
    import phalanx.torch as hvd

    ops = [hvd.Sum, hvd.Min, hvd.Max, hvd.Product]
    return [*ops, hvd.Average] if dtype.is_floating_point else ops


def _check_allreduce(fail: list[str], n: int, me: int) -> None:

    import phalanx.torch as hvd

    for dtype, dim in itertools.product(_dtypes(), SHAPES):
        for shape, op in itertools.product(SHAPES[dim], _ops_for(dtype)):
            mine = _gen(me, dtype, shape)
            want = _expected([_gen(r, dtype, shape) for r in range(n)], op)
            tag = f"{dtype} {shape} op={op}"
            if not _same(hvd.allreduce(mine, op=op), want):
                fail.append(f"allreduce {tag}")
            inplace = mine.clone()
            hvd.allreduce_(inplace, op=op)
            if not _same(inplace, want):
                fail.append(f"allreduce_ {tag}")
            h1 = hvd.allreduce_async(mine, op=op, name=f"a.{tag}")
            h2 = hvd.allreduce_async_(mine.clone(), op=op)
            if not (_same(hvd.synchronize(h2), want) and _same(hvd.synchronize(h1), want)):
                fail.append(f"allreduce_async (out of order sync) {tag}")


def _check_allreduce_extras(fail: list[str], n: int, me: int) -> None:
    import torch

    import phalanx.torch as hvd

    x = torch.full((4, 3), float(me + 1))
    total = sum(range(1, n + 1))
    if not torch.allclose(hvd.allreduce(x, average=False), torch.full((4, 3), float(total))):
        fail.append("average=False")
    got = hvd.allreduce(x, op=hvd.Sum, prescale_factor=2.0, postscale_factor=0.5)
    if not torch.allclose(got, torch.full((4, 3), float(total))):
        fail.append("prescale/postscale")
    outs = hvd.grouped_allreduce([x, x.double() * 2, torch.ones(9000) * me], op=hvd.Sum)
    if not (torch.allclose(outs[0], x * 0 + total) and torch.allclose(outs[1], (x * 0 + total).double() * 2)
            and torch.allclose(outs[2], torch.ones(9000) * sum(range(n)))):
        fail.append("grouped_allreduce")
    ins = [x.clone(), torch.ones(9000)]
    hvd.grouped_allreduce_(ins, op=hvd.Sum)
    if not (torch.allclose(ins[0], x * 0 + total) and torch.allclose(ins[1], torch.ones(9000) * n)):
        fail.append("grouped_allreduce_")
    h = hvd.grouped_allreduce_async([x], op=hvd.Max)
    if not torch.allclose(hvd.synchronize(h)[0], x * 0 + n):
        fail.append("grouped_allreduce_async")
    half = hvd.allreduce(x, compression=hvd.Compression.fp16, op=hvd.Sum)
    if half.dtype != torch.float32 or not torch.allclose(half, x * 0 + total):
        fail.append("fp16 compression")
    h = hvd.allreduce_async(torch.ones(50000))
    while not hvd.poll(h):
        pass
    if not torch.allclose(hvd.synchronize(h), torch.ones(50000)):
        fail.append("poll then synchronize")


def _check_allgather(fail: list[str], n: int, me: int) -> None:
    import torch

    import phalanx.torch as hvd

    for dtype, dim in itertools.product(_dtypes(), SHAPES):
        for shape in SHAPES[dim]:
            # The first dimension differs per rank.
            shapes = [(shape[0] + r, *shape[1:]) for r in range(n)]
            want = torch.cat([_gen(r, dtype, shapes[r], 7) for r in range(n)])
            mine = _gen(me, dtype, shapes[me], 7)
            if not torch.equal(hvd.allgather(mine), want):
                fail.append(f"allgather {dtype} {shape}")
            if not torch.equal(hvd.synchronize(hvd.allgather_async(mine)), want):
                fail.append(f"allgather_async {dtype} {shape}")
            same = _gen(me, dtype, shape, 8)
            if not torch.equal(hvd.allgather(same), torch.cat([_gen(r, dtype, shape, 8) for r in range(n)])):
                fail.append(f"allgather equal dims {dtype} {shape}")
    got = hvd.grouped_allgather([torch.ones(me + 1), torch.zeros(2, 2)])
    if got[0].shape != (sum(range(1, n + 1)),) or got[1].shape != (2 * n, 2):
        fail.append("grouped_allgather")


def _check_broadcast(fail: list[str], n: int, me: int) -> None:
    import torch

    import phalanx.torch as hvd

    for dtype, dim, root in itertools.product(_dtypes(), SHAPES, range(n)):
        for shape in SHAPES[dim]:
            want = _gen(root, dtype, shape, 3)
            mine = _gen(me, dtype, shape, 3)
            if not torch.equal(hvd.broadcast(mine, root), want):
                fail.append(f"broadcast {dtype} {shape} root={root}")
            inplace = mine.clone()
            hvd.broadcast_(inplace, root)
            h = hvd.broadcast_async(mine, root)
            if not (torch.equal(inplace, want) and torch.equal(hvd.synchronize(h), want)):
                fail.append(f"broadcast_/async {dtype} {shape} root={root}")
            if not torch.equal(mine, _gen(me, dtype, shape, 3)):
                fail.append(f"broadcast modified its input {dtype} {shape}")


def _check_alltoall(fail: list[str], n: int, me: int) -> None:
    import torch

    import phalanx.torch as hvd

    for dtype, dim in itertools.product(_dtypes(), SHAPES):
        for shape in SHAPES[dim]:
            rows = [shape[0] + r for r in range(n)]
            rest = [[(j + r) % 3 for j in range(1, n)] for r in range(n)]
            splits = [[rows[r] - sum(rest[r]), *rest[r]] for r in range(n)]
            data = [_gen(r, dtype, (rows[r], *shape[1:]), 5) for r in range(n)]
            want = torch.cat([data[r][sum(splits[r][:me]) : sum(splits[r][: me + 1])] for r in range(n)])
            out, received = hvd.alltoall(data[me], splits=splits[me])
            if not torch.equal(out, want) or received.tolist() != [splits[r][me] for r in range(n)]:
                fail.append(f"alltoall {dtype} {shape}")
    even = torch.arange(2 * n * 3).reshape(2 * n, 3) + 100 * me
    out, received = hvd.synchronize(hvd.alltoall_async(even))
    want = torch.cat([torch.arange(2 * n * 3).reshape(2 * n, 3)[2 * me : 2 * me + 2] + 100 * r for r in range(n)])
    if not torch.equal(out, want) or received.tolist() != [2] * n:
        fail.append("alltoall default splits")


def _check_reducescatter(fail: list[str], n: int, me: int) -> None:
    import torch

    import phalanx.torch as hvd

    for dtype, dim in itertools.product(_dtypes(), SHAPES):
        for shape, op in itertools.product(SHAPES[dim], [hvd.Sum, hvd.Min, hvd.Max]):
            full = _expected([_gen(r, dtype, shape, 9) for r in range(n)], op)
            base, extra = divmod(shape[0], n)
            start = me * base + min(me, extra)
            want = full[start : start + base + (1 if me < extra else 0)]
            if not torch.equal(hvd.reducescatter(_gen(me, dtype, shape, 9), op=op), want):
                fail.append(f"reducescatter {dtype} {shape} op={op}")
    x = torch.ones(n * 2 + 1, 3) * (me + 1)
    got = hvd.reducescatter(x)
    if not torch.allclose(got, torch.ones(got.shape[0], 3) * sum(range(1, n + 1)) / n):
        fail.append("reducescatter average")
    outs = hvd.grouped_reducescatter([x, x.double()], op=hvd.Sum)
    if outs[1].dtype != torch.float64 or not torch.allclose(outs[0], outs[1].float()):
        fail.append("grouped_reducescatter")


def _collectives_job() -> list[str]:
    import phalanx.torch as hvd

    hvd.init()
    n, me = hvd.size(), hvd.rank()
    fail: list[str] = []
    for check in (_check_allreduce, _check_allreduce_extras, _check_allgather, _check_broadcast,
                  _check_alltoall, _check_reducescatter):
        try:
            check(fail, n, me)
        except Exception as e:  # report, keep the job going so every rank reaches the same point
            fail.append(f"{check.__name__} raised {type(e).__name__}: {e}")
            break
    hvd.barrier()
    last = hvd.join()
    if not 0 <= last < n:
        fail.append(f"join returned {last}")
    hvd.shutdown()
    return fail


@pytest.mark.timeout(180)
@pytest.mark.parametrize("np", [2, 3])
def test_every_collective_over_dtypes_and_dims(np: int) -> None:
    results = phalanx.run(_collectives_job, np=np)
    assert results == [[]] * np


def _exact_scaling_job() -> list[str]:
    import torch

    import phalanx.torch as hvd

    hvd.init()
    fail: list[str] = []
    for i in range(12):  # repeated: the later calls take the speculative (predicted) path
        x = torch.randn(30_000, generator=torch.Generator().manual_seed(100 * i + hvd.rank()))
        total = hvd.allgather(x.unsqueeze(0)).sum(0)
        got = {"Average": hvd.allreduce(x), "Sum*4": hvd.allreduce(x, op=hvd.Sum, postscale_factor=4.0)}
        want = {"Average": total * (1.0 / hvd.size()), "Sum*4": total * 4.0}
        fail += [f"{k} call {i}" for k in got if not torch.equal(got[k], want[k])]
    hvd.shutdown()
    return fail


@pytest.mark.timeout(120)
@pytest.mark.parametrize("shm", ["0", "1"])
def test_new_tensor_average_is_bit_identical_to_sum_then_scale(shm: str) -> None:
    # A power-of-two size folds the scaling into the copy onto the wire; it must not change a bit.
    assert phalanx.run(_exact_scaling_job, np=2, env={"PHALANX_SHM": shm}) == [[], []]
