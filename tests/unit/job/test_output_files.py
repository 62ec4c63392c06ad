"""Files a job writes in shared directories never follow what another user planted (issue 32, item 5), and a
full disk under --output-filename does not end the job (item 4)."""

from __future__ import annotations

import logging
import os
import shutil
import stat
import subprocess
import sys
import tempfile
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from _users import NOBODY, as_nobody

from phalanx.env.files import UnsafePathError
from phalanx.errors import TimelineError
from phalanx.job.logs import FileSink
from phalanx.job.records import LogLine, Stream
from phalanx.timeline.writer import Timeline
from phalanx.torch.elastic.state import write_atomically

as_root = pytest.mark.skipif(os.getuid() != 0, reason="another local user (uid 65534) needs root")


@pytest.fixture
def shared() -> Iterator[Path]:
    """A directory like /tmp: everybody may create entries in it (sticky)."""
    path = Path(tempfile.mkdtemp(prefix="phalanx-shared-", dir="/tmp"))
    path.chmod(0o1777)
    yield path
    shutil.rmtree(path)


@pytest.fixture
def secret_file(tmp_path: Path) -> Path:
    target = tmp_path / "root-only"
    target.write_text("untouched\n")
    target.chmod(0o600)
    return target


@as_root
def test_a_directory_another_user_made_is_refused_before_anything_is_written(shared: Path, secret_file: Path) -> None:
    logs = shared / "logs"

    def plant() -> None:
        (logs / "rank.0").mkdir(parents=True)
        (logs / "rank.0" / "stdout").symlink_to(secret_file)

    assert as_nobody(plant) == 0
    with pytest.raises(UnsafePathError, match=rf"--output-filename {logs}: the directory belongs to uid {NOBODY}"):
        FileSink(logs)
    assert secret_file.read_text() == "untouched\n"


def test_planted_links_and_fifos_in_our_own_directory_are_not_followed(tmp_path: Path, secret_file: Path,
                                                                         caplog: pytest.LogCaptureFixture) -> None:
    logs = tmp_path / "logs"
    (logs / "rank.0").mkdir(parents=True)
    (logs / "rank.0" / "stdout").symlink_to(secret_file)
    (logs / "rank.1").mkdir()
    os.mkfifo(logs / "rank.1" / "stdout")  # opening it for writing used to block the driver for good
    sink = FileSink(logs)
    with caplog.at_level(logging.WARNING):
        sink.write(LogLine(0, Stream.STDOUT, "to the link"))
        sink.write(LogLine(1, Stream.STDOUT, "to the fifo"))
    sink.close()
    assert secret_file.read_text() == "untouched\n"
    assert "is a link or a FIFO" in caplog.text


def test_new_output_files_are_private(tmp_path: Path) -> None:
    sink = FileSink(tmp_path / "logs")
    sink.write(LogLine(1, Stream.STDOUT, "line"))
    sink.close()
    assert stat.S_IMODE((tmp_path / "logs" / "rank.1").stat().st_mode) == 0o700
    assert stat.S_IMODE((tmp_path / "logs" / "rank.1" / "stdout").stat().st_mode) == 0o600


def test_the_timeline_is_not_written_through_a_planted_link(tmp_path: Path, secret_file: Path) -> None:
    path = tmp_path / "timeline.json"
    path.symlink_to(secret_file)
    with pytest.raises(TimelineError, match="is a link"):
        Timeline(str(path))
    assert secret_file.read_text() == "untouched\n"


def test_the_checkpoints_temporary_name_cannot_be_planted(tmp_path: Path, secret_file: Path) -> None:
    (tmp_path / f".state.pt.{os.getpid()}.tmp").symlink_to(secret_file)  # the name used to be predictable
    write_atomically(tmp_path / "state.pt", {"step": 1})
    assert secret_file.read_text() == "untouched\n"
    assert torch.load(tmp_path / "state.pt", weights_only=True) == {"step": 1}
    assert stat.S_IMODE((tmp_path / "state.pt").stat().st_mode) == 0o600


_FULL_DISK = textwrap.dedent("""
    import logging, sys
    from phalanx.job.logs import FileSink
    from phalanx.job.records import LogLine, Stream
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    sink = FileSink(sys.argv[1])
    for i in range(2000):  # 2 MB into a 256 KiB filesystem
        sink.write(LogLine(i % 2, Stream.STDOUT, f"{i:04d} " + "x" * 1000))
        sink.flush()
    sink.close()
    print("all lines taken")
""")


@as_root
@pytest.mark.timeout(60)
def test_a_full_disk_under_output_filename_warns_once_and_the_job_goes_on(tmp_path: Path) -> None:
    """A raw ENOSPC from the sink used to end the driver's log pump, and with it the job (issue 32, item 4).
    The disk is a 256 KiB tmpfs in a private mount namespace: the real disk is never filled."""
    if shutil.which("unshare") is None:
        pytest.skip("needs util-linux unshare")
    small = tmp_path / "small"
    small.mkdir()
    script = f"mount -t tmpfs -o size=256k tmpfs {small} && exec {sys.executable} -c \"$0\" {small}/logs"
    proc = subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c", script, _FULL_DISK],
                          capture_output=True, text=True, timeout=50)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "all lines taken"
    warnings = [line for line in proc.stderr.splitlines() if "could not write the ranks' output files" in line]
    assert len(warnings) == 1, proc.stderr
    assert f"{small}/logs" in warnings[0] and "--output-filename" in warnings[0] and "No space left" in warnings[0]


_FULL_TMPDIR = textwrap.dedent("""
    from phalanx.job.channel import DriverChannel, Role, WorkerChannel
    from phalanx.job.framing import Kind
    from phalanx.job.records import ErrorRecord
    ch = DriverChannel(world_size=1, payload=b"p")
    peer = WorkerChannel.connect(ch.address, ch.secret, 0, Role.WORKER, timeout_s=20)
    peer.send(Kind.RESULT, b"r" * (2 << 20))  # over SPOOL_BYTES: spooled to TMPDIR, a 256 KiB filesystem
    while True:
        event = ch.events.get(timeout=20)
        if isinstance(event, ErrorRecord):
            print(event.rank, event.message)
            break
    peer.close()
    ch.close()
""")


@as_root
@pytest.mark.timeout(60)
def test_a_full_tmpdir_under_a_large_result_is_reported_with_the_disk(tmp_path: Path) -> None:
    """The ENOSPC used to be logged at debug level only and the job ended as 'rank 1 failed: exit code 143'
    (issue 32, item 7): the rank's failure now names the driver's disk, its path and TMPDIR."""
    if shutil.which("unshare") is None:
        pytest.skip("needs util-linux unshare")
    small = tmp_path / "small"
    small.mkdir()
    script = f"mount -t tmpfs -o size=256k tmpfs {small} && TMPDIR={small} exec {sys.executable} -c \"$0\""
    proc = subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c", script, _FULL_TMPDIR],
                          capture_output=True, text=True, timeout=50)
    assert proc.returncode == 0, proc.stderr
    rank, _, message = proc.stdout.strip().partition(" ")
    assert rank == "0" and "No space left on device" in message, proc.stdout
    assert f"in {small} (" in message and f"TMPDIR={small}" in message and "MiB free" in message
