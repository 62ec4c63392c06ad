"""The reader accepts traces still being written, Horovod's B/E traces, and rejects what is not a trace."""

from __future__ import annotations

from pathlib import Path

import pytest

from phalanx.errors import TimelineError
from phalanx.timeline.reader import load_trace, merge, parse_events, spans_from_events

LINES = [
    '{"name":"thread_name","ph":"M","pid":0,"tid":1,"args":{"name":"grad.w"}}',
    '{"name":"ALLREDUCE","ph":"X","pid":0,"tid":1,"ts":10.0,"dur":5.0,"args":{"bytes":400}}',
    '{"name":"ALLREDUCE","ph":"X","pid":0,"tid":1,"ts":20.0,"dur":7.0,"args":{"bytes":400}}',
]


@pytest.mark.parametrize(
    "text",
    [
        "[\n" + ",\n".join(LINES) + "\n]\n",  # closed
        "[\n" + ",\n".join(LINES) + ",\n",  # open, trailing comma: how a running job leaves it
        "[\n" + ",\n".join(LINES) + "\n",  # open, no comma
        "[\n" + ",\n".join(LINES) + ',\n{"name":"ALLRED',  # the writer is mid-line
        '{"traceEvents": [' + ",".join(LINES) + "]}",  # object format
    ],
)
def test_parse_variants(text: str) -> None:
    events = parse_events(text)
    spans, _ = spans_from_events(events)
    assert [(s.row, s.name, s.start_us, s.dur_us, s.nbytes) for s in spans] == [
        ("grad.w", "ALLREDUCE", 10.0, 5.0, 400),
        ("grad.w", "ALLREDUCE", 20.0, 7.0, 400),
    ]


def test_horovod_begin_end_pairs_and_process_rows() -> None:
    # Horovod: one process per tensor, B/E pairs, args on B; E may nest inside another B on the same row.
    text = "\n".join(
        [
            "[",
            '{"name": "process_name", "ph": "M", "pid": 1, "args": {"name": "grad.w"}},',
            '{"name": "NEGOTIATE_ALLREDUCE", "ph": "B", "ts": 100, "pid": 1},',
            '{"name": "", "ph": "E", "ts": 150, "pid": 1},',
            '{"name": "ALLREDUCE", "ph": "B", "ts": 150, "pid": 1, "args": {"dtype": "float32"}},',
            '{"name": "MEMCPY_IN_FUSION_BUFFER", "ph": "B", "ts": 151, "pid": 1},',
            '{"name": "", "ph": "E", "ts": 160, "pid": 1},',
            '{"name": "", "ph": "E", "ts": 400, "pid": 1},',
            '{"name": "ALLREDUCE", "ph": "B", "ts": 500, "pid": 1},',  # still running: no span yet
        ]
    )
    spans, _ = spans_from_events(parse_events(text))
    assert [(s.row, s.name, s.start_us, s.dur_us) for s in spans] == [
        ("grad.w", "NEGOTIATE_ALLREDUCE", 100.0, 50.0),
        ("grad.w", "ALLREDUCE", 150.0, 250.0),
        ("grad.w", "MEMCPY_IN_FUSION_BUFFER", 151.0, 9.0),
    ]
    assert spans[1].args == {"dtype": "float32"}


def test_not_a_trace() -> None:
    with pytest.raises(TimelineError, match="starts with"):
        parse_events("hello")
    with pytest.raises(TimelineError, match="event 1 is not JSON"):
        parse_events("[\n{oops},\n{},\n")
    assert parse_events("") == []


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(TimelineError, match="cannot read the trace"):
        load_trace([str(tmp_path / "nope.json")])


def test_merge_every_rank(tmp_path: Path) -> None:
    paths = []
    for rank in (0, 1):
        p = tmp_path / f"t.rank{rank}.json"
        p.write_text("[\n" + ",\n".join(line.replace('"pid":0', f'"pid":{rank}') for line in LINES) + ",\n")
        paths.append(str(p))
    out = tmp_path / "merged.json"
    assert merge(paths, str(out)) == 6
    trace = load_trace([str(out)])
    assert sorted({s.pid for s in trace.spans}) == [0, 1] and len(trace.spans) == 4
    with pytest.raises(TimelineError, match="cannot write the merged trace"):
        merge(paths, str(tmp_path / "no" / "dir.json"))


def test_bytes_from_shape_and_dtype_and_along_the_row() -> None:
    lines = [
        '{"name":"thread_name","ph":"M","pid":0,"tid":1,"args":{"name":"t"}}',
        '{"name":"NEGOTIATE_ALLREDUCE","ph":"X","pid":0,"tid":1,"ts":0,"dur":1,'
        '"args":{"dtype":"torch.float32","shape":[10,20]}}',
        '{"name":"ALLREDUCE","ph":"X","pid":0,"tid":1,"ts":1,"dur":1}',
        '{"name":"MEMCPY_IN_FUSION_BUFFER","ph":"X","pid":0,"tid":2,"ts":0,"dur":1,"args":{"bytes":64}}',
        '{"name":"ALLREDUCE","ph":"X","pid":0,"tid":2,"ts":1,"dur":1,"args":{"tensors":3}}',
        '{"name":"ALLREDUCE","ph":"X","pid":0,"tid":3,"ts":1,"dur":1,"args":{"dtype":"mystery","shape":[4]}}',
    ]
    spans, _ = spans_from_events(parse_events("[\n" + ",\n".join(lines) + ",\n"))
    got = {(s.tid, s.name): (s.nbytes, s.args) for s in spans}
    assert got[(1, "NEGOTIATE_ALLREDUCE")][0] == got[(1, "ALLREDUCE")][0] == 800
    assert got[(2, "ALLREDUCE")] == (64, {"bytes": 64, "tensors": 3})
    assert got[(3, "ALLREDUCE")][0] == 0  # unknown dtype: no guess
