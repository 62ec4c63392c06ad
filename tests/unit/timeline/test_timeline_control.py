"""Starting and stopping: current(), the env variables, ranks that record and ranks that do not."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from phalanx import timeline
from phalanx.env import names as env_names
from phalanx.errors import InvalidArgumentError


def test_current_is_none_until_started_and_after_stop(tmp_path: Path) -> None:
    assert timeline.current() is None
    tl = timeline.start_timeline(str(tmp_path / "t.json"))
    assert timeline.current() is tl and tl.recording
    timeline.stop_timeline()
    assert timeline.current() is None and not tl.recording
    json.loads((tmp_path / "t.json").read_text())
    timeline.stop_timeline()  # idempotent


def test_starting_again_stops_the_previous_timeline(tmp_path: Path) -> None:
    first = timeline.start_timeline(str(tmp_path / "a.json"))
    second = timeline.start_timeline(str(tmp_path / "b.json"))
    assert not first.recording and timeline.current() is second
    json.loads((tmp_path / "a.json").read_text())


def test_only_rank_0_records_by_default(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(env_names.RANK, "1")
    monkeypatch.setenv(env_names.WORLD_SIZE, "2")
    tl = timeline.start_timeline(str(tmp_path / "t.json"))
    assert isinstance(tl, timeline.NullTimeline) and not tl.recording
    tl.begin("x", timeline.ALLREDUCE)
    tl.end("x", timeline.ALLREDUCE)
    assert timeline.current() is None
    assert not (tmp_path / "t.json").exists()


@pytest.mark.parametrize("via_env", [False, True])
def test_every_rank_writes_its_own_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, via_env: bool) -> None:
    monkeypatch.setenv(env_names.RANK, "3")
    if via_env:
        monkeypatch.setenv(env_names.PHALANX_TIMELINE_ALL_RANKS, "1")
    tl = timeline.start_timeline(str(tmp_path / "t.json"), all_ranks=None if via_env else True)
    assert tl.path == str(tmp_path / "t.rank3.json") and timeline.current() is tl
    tl.begin("x", timeline.ALLREDUCE)
    tl.end("x", timeline.ALLREDUCE)
    timeline.stop_timeline()
    events = json.loads((tmp_path / "t.rank3.json").read_text())
    assert {e["pid"] for e in events} == {3}
    assert {"name": "process_name", "ph": "M", "pid": 3,
            "args": {"name": "rank 3", "start_time_since_epoch_in_micros": 0}} in events  # Horovod's key


def test_rank_path() -> None:
    assert timeline.rank_path("/x/t.json", 2) == "/x/t.rank2.json"
    assert timeline.rank_path("/x/trace", 0) == "/x/trace.rank0"


def test_start_from_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert timeline.start_from_env() is None
    monkeypatch.setenv(env_names.HOROVOD_TIMELINE, "DYNAMIC")
    assert timeline.start_from_env() is None and timeline.current() is None
    path = str(tmp_path / "t.json")
    monkeypatch.setenv(env_names.HOROVOD_TIMELINE, path)
    monkeypatch.setenv(env_names.HOROVOD_TIMELINE_MARK_CYCLES, "true")
    tl = timeline.start_from_env()
    assert tl is not None and tl is timeline.current() and tl.path == path and tl.mark_cycles
    tl.begin("x", timeline.ALLREDUCE)
    tl.end("x", timeline.ALLREDUCE)
    assert timeline.start_from_env() is tl  # hvd.init() twice does not truncate the running trace


def test_start_from_env_every_rank(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(env_names.RANK, "1")
    monkeypatch.setenv(env_names.PHALANX_TIMELINE_ALL_RANKS, "1")
    monkeypatch.setenv(env_names.HOROVOD_TIMELINE, str(tmp_path / "t.json"))
    tl = timeline.start_from_env()
    assert tl is not None and tl.path == str(tmp_path / "t.rank1.json")
    assert timeline.start_from_env() is tl
    assert os.path.exists(tmp_path / "t.rank1.json")


def test_max_mb_from_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(env_names.PHALANX_TIMELINE_MAX_MB, "0.05")
    tl = timeline.start_timeline(str(tmp_path / "t.json"))
    assert tl._file._segment_bytes == int(0.05 * 1024 * 1024) // 2
    for bad in ("lots", "-1"):
        monkeypatch.setenv(env_names.PHALANX_TIMELINE_MAX_MB, bad)
        with pytest.raises(InvalidArgumentError, match=env_names.PHALANX_TIMELINE_MAX_MB):
            timeline.start_timeline(str(tmp_path / "t.json"))


def test_malformed_rank_is_a_clear_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(env_names.RANK, "zero")
    with pytest.raises(InvalidArgumentError, match="RANK='zero'"):
        timeline.start_timeline(str(tmp_path / "t.json"))


def test_a_forked_child_does_not_touch_the_parents_trace(tmp_path: Path) -> None:
    tl = timeline.start_timeline(str(tmp_path / "t.json"))
    tl.begin("x", timeline.ALLREDUCE)
    tl.end("x", timeline.ALLREDUCE)
    pid = os.fork()
    if pid == 0:  # the child: no timeline; stopping must not write the parent's closing bracket
        ok = timeline.current() is None
        tl.close()
        timeline.stop_timeline()
        os._exit(0 if ok else 3)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert timeline.current() is tl and tl.recording
    timeline.stop_timeline()
    events = json.loads((tmp_path / "t.json").read_text())  # exactly one footer: strict JSON
    assert sum(e.get("ph") == "X" for e in events) == 1
