"""phalanx.worker.deepspeed_ops: DeepSpeed's JIT op builds in a rank (one per host, no stale baton, no
shared-memory op that would never be initialized)."""

from __future__ import annotations

import os
import subprocess
import sys
import types
from collections.abc import Iterator
from pathlib import Path

import pytest

from phalanx.errors import StartTimeoutError
from phalanx.worker import deepspeed_ops as ops

HOLD = """
import fcntl, os, sys, time
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT)
fcntl.flock(fd, fcntl.LOCK_EX)
print("held", flush=True)
time.sleep(60)  # under test: the lock stays held until the fixture kills this process
"""


@pytest.fixture
def holder(tmp_path: Path) -> Iterator[subprocess.Popen[str]]:
    """Another process holding the host lock of ``tmp_path``."""
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(tmp_path / ops.LOCK_NAME)], stdout=subprocess.PIPE,
                            text=True)
    assert proc.stdout is not None and proc.stdout.readline() == "held\n"
    yield proc
    proc.kill()
    proc.wait()


@pytest.mark.parametrize(("local", "world", "used"), [
    (None, "2", False), ("2", "2", True), ("1", "2", False), ("x", "2", False), ("1", "1", True)])
def test_the_shm_op_is_used_only_when_local_size_covers_the_world(local: str | None, world: str,
                                                                   used: bool) -> None:
    env = {"WORLD_SIZE": world, **({"LOCAL_SIZE": local} if local is not None else {})}
    assert ops.shm_op_is_used(env) is used


def test_a_held_host_lock_times_out_naming_the_lock(tmp_path: Path, holder: subprocess.Popen[str]) -> None:
    with pytest.raises(StartTimeoutError, match=r"waited 0.3 s .*phalanx-deepspeed-jit.lock"), \
            ops.host_lock(str(tmp_path), timeout_s=0.3):
        pass
    holder.kill()
    holder.wait()
    with ops.host_lock(str(tmp_path), timeout_s=5):  # released by the holder's death
        pass


def test_the_host_lock_does_not_follow_a_planted_link(tmp_path: Path) -> None:
    target = tmp_path / "elsewhere"
    (tmp_path / ops.LOCK_NAME).symlink_to(target)
    with pytest.raises(OSError), ops.host_lock(str(tmp_path)):
        pass
    assert not target.exists()


def test_a_stale_baton_is_removed_and_a_live_build_s_is_kept(tmp_path: Path) -> None:
    (tmp_path / "lock").touch()
    busy = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], cwd=tmp_path)  # a live build
    try:
        assert not ops.clear_stale_baton(str(tmp_path))
        assert (tmp_path / "lock").exists()
    finally:
        busy.kill()
        busy.wait()
    assert ops.clear_stale_baton(str(tmp_path))
    assert not (tmp_path / "lock").exists()


def test_install_wraps_deepspeed_s_builds(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With stand-ins for DeepSpeed's two modules: the shm op is skipped, a JIT build runs under the host lock
    after a stale baton of its build directory was removed."""
    from torch.utils import cpp_extension

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    monkeypatch.delenv("LOCAL_SIZE", raising=False)
    monkeypatch.setattr(sys, "meta_path", list(sys.meta_path))
    seen: dict[str, object] = {}

    class OpBuilder:
        name = "fake_op"

        def jit_load(self, verbose: bool = True) -> str:
            import fcntl

            fd = os.open(tmp_path / ops.LOCK_NAME, os.O_RDWR)
            try:
                with pytest.raises(BlockingIOError):
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            finally:
                os.close(fd)
            seen["baton"] = os.path.exists(os.path.join(build, "lock"))
            return "built"

    build = cpp_extension._get_build_directory("fake_op", False)
    Path(build, "lock").touch()
    comm = types.ModuleType(ops.COMM_MODULE)
    comm.build_shm_op = lambda: "shm op"  # type: ignore[attr-defined]
    builder = types.ModuleType(ops.BUILDER_MODULE)
    builder.OpBuilder = OpBuilder  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, ops.COMM_MODULE, comm)
    monkeypatch.setitem(sys.modules, ops.BUILDER_MODULE, builder)
    ops.install()
    assert comm.build_shm_op() is None  # type: ignore[attr-defined]
    assert OpBuilder().jit_load() == "built"
    assert seen == {"baton": False}
    monkeypatch.setenv("LOCAL_SIZE", "2")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert comm.build_shm_op() == "shm op"  # type: ignore[attr-defined]
