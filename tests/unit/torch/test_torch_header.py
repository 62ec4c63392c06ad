"""The control block, reduce helpers, bucket layout and name validation (no processes)."""

from __future__ import annotations

import pytest
import torch

# white-box: the engine's wire format and its parts: internal (no public name)
from phalanx.torch._engine import header as _header
from phalanx.torch._engine import names as _names
from phalanx.torch._engine import reduce as _reduce
from phalanx.torch._engine.collective import Entry
from phalanx.torch._engine.collectives import Barrier
from phalanx.torch._train import buckets as _buckets


def _sig(**kw: object) -> _header.Signature:
    base: dict[str, object] = {"kind": "allreduce", "name": "grad.w", "dtype": torch.float32, "device": 0,
                               "shape": (4, 3), "op": _reduce.Average}
    base.update(kw)
    return _header.Signature(**base)  # type: ignore[arg-type]


def test_encode_decode_round_trip_with_inline_payload_and_aux() -> None:
    sig = _sig(name="ü" * 10, shape=(2, 3, 4, 5), prescale=0.25, postscale=3.0, group_hash=7, count=2, root=1)
    payload = torch.arange(24, dtype=torch.float32).view(-1).view(torch.uint8)
    block = _header.encode(sig, [5, 6, 7], payload, n_aux=3)
    assert block.numel() == _header.HEADER_WORDS + 3 + _header.INLINE_WORDS
    words = block[: _header.HEADER_WORDS].tolist()
    assert _header.decode(words) == sig
    assert block[_header.HEADER_WORDS : _header.HEADER_WORDS + 3].tolist() == [5, 6, 7]
    assert words[_header.F_NBYTES] == 96
    got = block[_header.HEADER_WORDS + 3 :].view(torch.uint8)[:96].view(torch.float32)
    assert torch.equal(got, torch.arange(24, dtype=torch.float32))


def test_cached_blocks_are_never_written_and_repeat_bit_for_bit() -> None:
    sig = _sig(shape=(2,))
    header_only = _header.encode(sig, [], None, 2, inline_words=0)
    assert _header.encode(_sig(shape=(2,)), [], None, 2, inline_words=0) is header_only  # cached, read-only
    first = _header.encode(sig, [], torch.tensor([1.0, 2.0]).view(torch.uint8), 2)
    second = _header.encode(sig, [3], torch.tensor([5.0, 6.0]).view(torch.uint8), 2)
    third = _header.encode(sig, [], torch.tensor([1.0, 2.0]).view(torch.uint8), 2)
    assert torch.equal(first, third) and not torch.equal(first, second)  # payloads never leak between calls
    assert first[_header.HEADER_WORDS : _header.HEADER_WORDS + 2].tolist() == [0, 0]
    assert second[_header.HEADER_WORDS : _header.HEADER_WORDS + 2].tolist() == [3, 0]
    assert _header.decode(first[: _header.HEADER_WORDS].tolist()) == sig
    other = _sig(shape=(2,), op=_reduce.Sum)  # any field of the signature changes the block
    assert _header.decode(_header.encode(other, [], None, 2)[: _header.HEADER_WORDS].tolist()) == other


@pytest.mark.parametrize("op", [_reduce.Sum, _reduce.Average, _reduce.Min, _reduce.Max, _reduce.Product])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.int16, torch.bool])
def test_inline_reduction_matches_the_stacked_reduction_bitwise(op: int, dtype: torch.dtype) -> None:
    # white-box: the engine's wire format and its parts: internal (no public name)
    from phalanx.torch._engine.collectives import _reduce_rows

    if dtype == torch.bool and op == _reduce.Average:
        return
    gen = torch.Generator().manual_seed(op)
    rows = [(torch.randn(257, generator=gen) * 100).to(dtype) for _ in range(3)]
    out = torch.empty(257, dtype=dtype)
    _reduce_rows(rows, op, out)
    assert torch.equal(out, _reduce.reduce_stack(torch.stack(rows), op))


def test_long_names_are_truncated_not_rejected() -> None:
    sig = _sig(name="x" * 500)
    words = _header.encode(sig, [], None, 2)[: _header.HEADER_WORDS].tolist()
    assert _header.decode(words).name == "x" * (_header.NAME_WORDS * 8)


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"shape": (4, 4)}, "shape"), ({"dtype": torch.float64}, "dtype"), ({"op": _reduce.Sum}, "op"),
        ({"kind": "allgather"}, "kind"), ({"process_set_id": 3}, "process set"), ({"name": "other"}, "name"),
        ({"device": 1}, "device"), ({"postscale": 2.0}, "postscale_factor"), ({"count": 3}, "grouped tensors"),
    ],
)
def test_find_mismatch_names_the_field_and_every_ranks_value(changes: dict[str, object], field: str) -> None:
    sigs = [_sig(), _sig(**changes), _sig()]
    detail = _header.find_mismatch(sigs, [0, 2, 5])
    assert detail is not None and detail.startswith(f"{field}:")
    assert "rank 0=" in detail and "rank 2=" in detail and "rank 5=" in detail
    err = _header.mismatch_error(sigs, [0, 2, 5], detail, me=2)
    assert isinstance(err, RuntimeError) and "ranks [0, 2, 5]" in str(err)


def test_allgather_first_dimension_may_differ_and_unnamed_ops_skip_the_name() -> None:
    sigs = [_sig(kind="allgather", shape=(1, 3)), _sig(kind="allgather", shape=(9, 3), name="")]
    assert _header.find_mismatch(sigs, [0, 1]) is None
    assert _header.find_mismatch([sigs[0], _sig(kind="allgather", shape=(9, 4))], [0, 1]) == (
        "trailing shape: rank 0=(3,), rank 1=(4,)"
    )


def test_op_resolution_and_validation() -> None:
    assert _reduce.resolve_op(None, None) == _reduce.Average
    assert _reduce.resolve_op(None, False) == _reduce.Sum
    with pytest.raises(ValueError, match="deprecated"):
        _reduce.resolve_op(_reduce.Sum, True)
    with pytest.raises(NotImplementedError, match="Adasum"):
        _reduce.check_op(_reduce.Adasum, torch.float32)
    with pytest.raises(ValueError, match="bool"):
        _reduce.check_op(_reduce.Average, torch.bool)
    with pytest.raises(ValueError, match="complex"):
        _reduce.check_op(_reduce.Max, torch.complex64)


def test_reduce_stack_in_rank_order() -> None:
    stack = torch.tensor([[1, 5], [3, 2], [2, 2]], dtype=torch.int32)
    assert _reduce.reduce_stack(stack, _reduce.Sum).tolist() == [6, 9]
    assert _reduce.reduce_stack(stack, _reduce.Min).tolist() == [1, 2]
    assert _reduce.reduce_stack(stack, _reduce.Max).tolist() == [3, 5]
    assert _reduce.reduce_stack(stack, _reduce.Product).dtype == torch.int32
    flags = torch.tensor([[True, False], [False, False]])
    assert _reduce.reduce_stack(flags, _reduce.Sum).tolist() == [True, False]
    assert _reduce.reduce_stack(flags, _reduce.Min).tolist() == [False, False]
    t = torch.tensor([7, 9, -7])
    _reduce.finish_scale(t, _reduce.Average, 2, 1.0)
    assert t.tolist() == [3, 4, -3]  # integer Average: the quotient rounded toward zero (Horovod's)


def test_bucket_plan_reverse_order_threshold_and_dtype_breaks() -> None:
    params = [torch.zeros(10), torch.zeros(10), torch.zeros(10, dtype=torch.float64), torch.zeros(100)]
    buckets = _buckets.plan(params, threshold_bytes=100, groups=None)
    assert [[p.numel() for p in b.params] for b in buckets] == [[100], [10], [10, 10]]
    grouped = _buckets.plan(params, threshold_bytes=1 << 30, groups=[[params[0], params[2]], [params[1], params[3]]])
    assert [len(b.params) for b in grouped] == [1, 1, 2]


def test_pack_folds_the_scale_and_makes_grads_views() -> None:
    p = torch.nn.Parameter(torch.zeros(3))
    q = torch.nn.Parameter(torch.zeros(2))
    p.grad = torch.tensor([2.0, 4.0, 6.0])
    bucket = _buckets.plan([p, q], 1 << 20, None)[0]
    _buckets.pack(bucket, 0.5)
    assert p.grad.tolist() == [1.0, 2.0, 3.0] and q.grad.tolist() == [0.0, 0.0]
    assert p.grad.data_ptr() == bucket.view(1).data_ptr()
    p.grad.add_(1.0)  # accumulated in place since: the next pack scales it in place
    _buckets.pack(bucket, 0.5)
    assert p.grad.tolist() == [1.0, 1.5, 2.0]


def test_predictor_needs_a_confirmed_period_and_reads_aabb_as_period_four() -> None:
    # white-box: the engine's wire format and its parts: internal (no public name)
    from phalanx.torch._engine import speculate as speculation

    big_a = speculation.key_of(_sig(shape=(100_000,), op=_reduce.Sum))
    big_b = speculation.key_of(_sig(shape=(200_000,), op=_reduce.Sum))
    pred = speculation.Predictor()
    for _ in range(speculation.CONFIRM - 1):
        pred.record(big_a)
    assert pred.predict() is None
    pred.record(big_a)
    assert pred.predict() == big_a
    pred = speculation.Predictor()
    for k in [big_a, big_a, big_b, big_b] * 3:
        pred.record(k)
    assert pred.predict() == big_a
    pred.record(big_a)
    assert pred.predict() == big_a
    pred.record(big_a)
    assert pred.predict() == big_b
    small = speculation.key_of(_sig(shape=(4,)))
    pred = speculation.Predictor()
    for _ in range(speculation.CONFIRM):
        pred.record(small)
    assert pred.predict() is None  # inline-sized collectives are never speculated on
    for k in [big_a] * speculation.CONFIRM + [small] * (speculation.MAX_PERIOD - 1):
        pred.record(k)  # period MAX_PERIOD: big_a is the next guess as long as it is in the last MAX_PERIOD
    assert pred.since_worth == speculation.MAX_PERIOD - 1
    pred.record(small)
    assert pred.predict() is None


def test_default_fusion_threshold_splits_only_when_buckets_can_overlap(monkeypatch: pytest.MonkeyPatch) -> None:
    from phalanx.env import names as env_names
    from phalanx.torch.optimizer import DEFAULT_FUSION_THRESHOLD_BYTES, MIN_AUTO_BUCKET_BYTES, fusion_threshold_bytes

    monkeypatch.delenv(env_names.HOROVOD_FUSION_THRESHOLD, raising=False)
    assert fusion_threshold_bytes(40 << 20) == 10 << 20  # about 4 buckets, overlapping backward
    assert fusion_threshold_bytes(1 << 20) == MIN_AUTO_BUCKET_BYTES
    assert fusion_threshold_bytes(40 << 20, overlap=False) == DEFAULT_FUSION_THRESHOLD_BYTES  # shm: one bucket
    monkeypatch.setenv(env_names.HOROVOD_FUSION_THRESHOLD, "4096")
    assert fusion_threshold_bytes(40 << 20, overlap=False) == 4096  # the user's choice wins
    monkeypatch.setenv(env_names.HOROVOD_FUSION_THRESHOLD, "lots")
    with pytest.raises(ValueError, match="HOROVOD_FUSION_THRESHOLD='lots'"):
        fusion_threshold_bytes()


def _named_round(table: _names.Table, sigs: list[_header.Signature], me: int = 0) -> tuple[Entry, _names.Outcome]:
    """One negotiation round as rank ``me`` of a 2-rank set sees it."""
    coll = _names.Wait(sigs[me], True) if sigs[me].kind == "wait" else Barrier(sigs[me])
    entry = Entry(coll=coll, groups=None)
    rows = [torch.full((4,), float(i)) for i in range(len(sigs))]
    return entry, _names.add_round(table, entry, me, rows, sigs, [0, 1])


def _wait(blocked: bool = True) -> _header.Signature:
    return _names.Wait(_sig(), blocked).sig


def test_named_collectives_issued_in_different_orders_run_when_every_rank_has_issued_them() -> None:
    table = _names.Table(2)
    a, out = _named_round(table, [_sig(name="a"), _sig(name="b")])
    assert a.state == "parked" and not out.ready and set(table.pending) == {("name", "a"), ("name", "b")}
    b, out = _named_round(table, [_sig(name="b"), _sig(name="a")])
    assert [entry for entry, _, _ in out.ready] == [a, b]  # in the order the names entered the table
    rows, sigs = out.ready[0][1], out.ready[0][2]
    assert [float(r[0]) for r in rows] == [0.0, 1.0] and [s.name for s in sigs] == ["a", "a"]
    assert not table.pending and not table.mine


def test_unnamed_collectives_match_by_their_order_of_issue() -> None:
    table = _names.Table(2)
    _, out = _named_round(table, [_sig(name="a"), _sig(kind="barrier", name="")])
    assert set(table.pending) == {("name", "a"), ("unnamed", 0)}
    barrier, out = _named_round(table, [_sig(kind="barrier", name=""), _wait()])
    assert [entry for entry, _, _ in out.ready] == [barrier] and set(table.pending) == {("name", "a")}


def test_a_round_of_blocked_waits_fails_every_pending_collective_naming_them() -> None:
    table = _names.Table(2)
    a, _ = _named_round(table, [_sig(name="a"), _sig(name="b")])
    _, out = _named_round(table, [_wait(blocked=False), _wait()])  # rank 0 only polls: it may issue more
    assert not out.failed and not out.error
    _, out = _named_round(table, [_wait(), _wait()])
    assert out.failed == [a] and not table.pending and not table.mine
    assert "name: rank 0=a, rank 1=b" in out.error and "ranks [0, 1]" in out.error
    assert "allreduce 'b' issued by rank(s) [1], not by [0]" in out.error


def test_steps_and_joins_match_by_position_and_errors_show_what_a_waiting_rank_has_pending() -> None:
    table = _names.Table(2)
    _named_round(table, [_sig(name="a"), _sig(name="b")])
    step = _sig(kind="optimizer step", name="", root=0)
    assert _names.ordered([step, _wait()]) and not _names.ordered([_sig(), _wait()])
    shown = _names.shown(table, [step, _wait()])
    assert shown[0] is step and shown[1].name == "b"
    assert _header.find_mismatch(shown, [0, 1]) == "kind: rank 0=optimizer step, rank 1=allreduce"
