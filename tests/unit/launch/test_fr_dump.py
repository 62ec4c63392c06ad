"""torch's Flight Recorder dump files, collected by whoever started the rank: the private directory, the
summary of a dump written the way torch writes it, and what is refused (a pickle naming anything but plain
data, a planted link, an oversized file, control characters)."""

from __future__ import annotations

import os
import pickle
import stat
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import pytest

from phalanx.launch import fr_dump
from phalanx.launch.fr_dump import DumpDir


class _IntList(list):  # type: ignore[type-arg]
    """Pickles as torch's pickler writes a typed int list: through ``torch.jit._pickle.build_intlist``."""

    def __reduce__(self) -> Any:
        import torch.jit._pickle

        return (torch.jit._pickle.build_intlist, (list(self),))


def _entry(seq: int, state: str) -> dict[str, Any]:
    return {"record_id": seq, "pg_id": 0, "process_group": ("0", "default_pg"), "collective_seq_id": seq,
            "p2p_seq_id": 0, "op_id": seq, "profiling_name": "nccl:all_reduce", "time_created_ns": 1,
            "input_sizes": [_IntList([1024])], "input_dtypes": ["Float"], "output_sizes": [_IntList([1024])],
            "output_dtypes": ["Float"], "state": state, "timeout_ms": 600000, "is_p2p": False, "retired": False,
            "frames": [{"name": "step", "filename": "train.py", "line": 41}]}


def _torch_like_dump(entries: int = 12) -> bytes:
    return pickle.dumps({"version": "2.10", "pg_config": {"0": {"name": "0", "desc": "default_pg", "ranks": "[0, 1]"}},
                         "pg_status": {"0": {"last_enqueued_collective": entries, "last_started_collective": entries,
                                             "last_completed_collective": entries - 1}},
                         "entries": [_entry(i + 1, "completed" if i + 1 < entries else "started")
                                     for i in range(entries)]}, protocol=2)


def _write_as_torch(d: DumpDir, rank: int, data: bytes) -> Path:
    path = Path(d.env()["TORCH_FR_DUMP_TEMP_FILE"] + str(rank))  # torch: <prefix><global rank>
    path.write_bytes(data)
    return path


def test_a_private_directory_per_rank_named_by_both_of_torchs_variables() -> None:
    d = DumpDir.create({})
    assert d.path is not None
    try:
        st = os.lstat(d.path)
        assert stat.S_ISDIR(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o700 and st.st_uid == os.geteuid()
        env = d.env()
        assert env == {"TORCH_FR_DUMP_TEMP_FILE": os.path.join(d.path, "nccl_trace_rank_"),
                       "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": os.path.join(d.path, "nccl_trace_rank_")}
        other = DumpDir.create({})
        assert other.path != d.path and other.collect(failed=True) == []
    finally:
        assert d.collect(failed=True) == []  # nothing written: nothing sent, the directory removed
    assert not os.path.exists(d.path)
    # the user chose where dumps go: phalanx leaves it alone
    for name in ("TORCH_FR_DUMP_TEMP_FILE", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE"):
        mine = DumpDir.create({name: "/data/fr/trace_"})
        assert mine.path is None and mine.env() == {} and mine.collect(failed=True) == []


def test_a_dump_written_as_torch_writes_it_is_summarized_and_kept_when_the_rank_failed() -> None:
    d = DumpDir.create({})
    assert d.path is not None
    path = _write_as_torch(d, 3, _torch_like_dump())
    lines = d.collect(failed=True)
    assert lines[0].startswith("phalanx: torch's Flight Recorder dump of rank 3 (written by NCCL's watchdog; "
                               f"kept at {os.uname().nodename}:{path}), version 2.10:"), lines[0]
    assert lines[1] == "  group 0: last enqueued #12, started #12, completed #11"
    assert len(lines) == 2 + fr_dump.SHOWN_ENTRIES  # the last entries only
    assert lines[2].startswith("  #5 nccl:all_reduce on group 0 (completed) inputs [[1024]] ['Float']")
    assert lines[-1] == ("  #12 nccl:all_reduce on group 0 (started) inputs [[1024]] ['Float'] at train.py:41 "
                         "in step")
    assert path.exists()  # kept for torch's fr_trace
    path.unlink()
    os.rmdir(d.path)


def test_a_dump_of_a_rank_that_succeeded_is_removed_unsent() -> None:
    d = DumpDir.create({})
    assert d.path is not None
    _write_as_torch(d, 0, _torch_like_dump())
    assert d.collect(failed=False) == []
    assert not os.path.exists(d.path)


class _Planted:
    def __reduce__(self) -> Any:
        return (os.system, ("touch /tmp/phalanx-fr-test-pwned",))


@pytest.mark.parametrize("case", ["pickle of a callable", "planted link", "oversized", "not a pickle", "not a dump"])
def test_what_is_not_a_plain_dump_is_refused_and_said(case: str, tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    d = DumpDir.create({})
    assert d.path is not None
    name = d.env()["TORCH_FR_DUMP_TEMP_FILE"] + "1"
    if case == "pickle of a callable":
        Path(name).write_bytes(pickle.dumps({"entries": [_Planted()]}))
        want = "refused: it names posix.system, which a Flight Recorder dump never holds"
    elif case == "planted link":
        (tmp_path / "secret").write_bytes(_torch_like_dump())
        os.symlink(tmp_path / "secret", name)
        want = "not opened (Too many levels of symbolic links)"
    elif case == "oversized":
        monkeypatch.setattr(fr_dump, "MAX_BYTES", 100)
        Path(name).write_bytes(_torch_like_dump())
        want = "bytes, more than the 100 read"
    elif case == "not a pickle":
        Path(name).write_bytes(b"\x80\x02garbage")
        want = "refused: pickle data was truncated"
    else:
        Path(name).write_bytes(pickle.dumps(["a", "list"]))
        want = "refused: not a Flight Recorder dump (no list of entries)"
    lines = d.collect(failed=True)
    assert len(lines) == 1 and want in lines[0], lines
    assert not os.path.exists("/tmp/phalanx-fr-test-pwned")
    for entry in os.listdir(d.path):
        os.unlink(os.path.join(d.path, entry))
    os.rmdir(d.path)


def test_control_characters_from_the_dump_never_reach_the_console() -> None:
    dump = pickle.loads(_torch_like_dump(1))
    dump["entries"][0]["profiling_name"] = "nccl:all_reduce\x1b]0;owned\x07\nfake line"
    lines = fr_dump.summarize(0, dump, "h:/p")
    assert all(not any(ord(c) < 32 or 127 <= ord(c) < 160 for c in line) for line in lines)
    assert "nccl:all_reduce?]0;owned??fake line" in lines[-1]


def test_empty_directories_of_a_launcher_that_is_gone_are_swept_and_a_kept_dump_stays() -> None:
    gone = subprocess.Popen(["true"])
    gone.wait()
    tmp = Path(tempfile.gettempdir())
    empty_gone = tmp / f"phalanx-fr-{gone.pid}-abc123"
    kept_gone = tmp / f"phalanx-fr-{gone.pid}-def456"
    mine = tmp / f"phalanx-fr-{os.getpid()}-ghi789"
    for d in (empty_gone, kept_gone, mine):
        d.mkdir(mode=0o700)
    (kept_gone / "nccl_trace_rank_0").write_bytes(_torch_like_dump(1))
    try:
        fr_dump.sweep_once.cache_clear()
        fr_dump.sweep_once()
        assert not empty_gone.exists() and kept_gone.exists() and mine.exists()
        d = DumpDir.create({})  # named after its creator
        assert d.path is not None and os.path.basename(d.path).startswith(f"phalanx-fr-{os.getpid()}-")
        assert d.collect(failed=False) == []
    finally:
        (kept_gone / "nccl_trace_rank_0").unlink()
        for path in (empty_gone, kept_gone, mine):
            if path.exists():
                path.rmdir()
