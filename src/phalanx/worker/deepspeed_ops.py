"""DeepSpeed's JIT-built C++ ops in a phalanx rank: the first DeepSpeed job on a host is as reliable as the tenth.

DeepSpeed builds an op it has no prebuilt copy of (``DS_BUILD_OPS=0`` installs none) on first use, with ninja,
into torch's extensions directory, in every rank that needs it at once. Right after DeepSpeed's modules are
imported, two of its functions are wrapped in every rank of a phalanx job:

- ``deepspeed.comm.torch.build_shm_op``, which every ``TorchBackend`` (every ``deepspeed.init_distributed``
  on CPU) calls before it joins the process group, builds the ``deepspeed_shm_comm`` op only where the op would
  be used. The op's ``initialize`` turns its shared-memory allreduce on only when ``LOCAL_SIZE`` (set by
  DeepSpeed's own launcher) equals the world size; phalanx's launchers do not set ``LOCAL_SIZE``, because the
  op never unlinks its ``/dev/shm`` segments. Elsewhere the build (a minute of compiling on 2 cores, in every
  rank of the first job) buys nothing, and the built op is harmful: ``inference_all_reduce`` would run its
  kernel on buffers ``initialize`` never mapped. Without the op DeepSpeed uses ``torch.distributed``'s
  all_reduce, as on every platform the op does not support.
- ``OpBuilder.jit_load`` (every JIT build: ``cpu_adam`` for an ``Adam`` without ``torch_adam``, the shm op
  where ``LOCAL_SIZE`` asks for it) runs under one lock per extensions directory, a file locked with
  ``flock``: one rank builds, the others wait (at most :data:`JIT_BUILD_TIMEOUT_S`) and then load the op it
  built. Holding it, a rank also removes a stale ``lock`` file of torch's own (``FileBaton``) from the op's
  build directory: torch creates it for the length of a build and removes it after, so one left by a build
  that was killed (a rank torn down by a failing peer, a Ctrl-C) makes every later build on the host wait for
  it forever. A baton counts as stale when no process runs in the build directory (ninja and the compilers
  run there); a build by a process outside phalanx's jobs that has taken the baton but not yet started ninja
  is the one case this cannot see.

:func:`install` is called by the worker entry (function ranks) and by the start-up hook
``phalanx-shm-native.pth`` (command ranks). It imports nothing: the wrapping happens only once DeepSpeed's
modules are imported by the user's code.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import functools
import importlib.abc
import importlib.machinery
import os
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from phalanx.errors import StartTimeoutError
from phalanx.worker import dist_backend

#: The module whose ``build_shm_op`` builds the CPU shared-memory op (``TorchBackend.__init__`` calls it).
COMM_MODULE = "deepspeed.comm.torch"
#: The module of ``OpBuilder``, whose ``jit_load`` every JIT build goes through.
BUILDER_MODULE = "deepspeed.ops.op_builder.builder"
#: Longest wait for another process's build of a DeepSpeed op on this host (a cold build of the largest CPU
#: op, ``cpu_adam``, takes about 2 minutes on 2 busy cores).
JIT_BUILD_TIMEOUT_S = 900.0
#: The lock's file name inside torch's extensions directory (``TORCH_EXTENSIONS_DIR`` or its default).
LOCK_NAME = "phalanx-deepspeed-jit.lock"
_POLL_S = 0.2
_MARK = "__phalanx_wrapped__"


def shm_op_is_used(environ: Mapping[str, str]) -> bool:
    """Whether the ``deepspeed_shm_comm`` op would turn its shared-memory path on in a rank with ``environ``:
    its ``initialize`` does when ``LOCAL_SIZE`` equals the world size (every rank on this host)."""
    local, world = environ.get("LOCAL_SIZE", ""), environ.get("WORLD_SIZE", "")
    return local.isdigit() and local == world and int(local) >= 1


def extensions_root(environ: Mapping[str, str]) -> str:
    """torch's JIT extensions directory: ``TORCH_EXTENSIONS_DIR``, else ``~/.cache/torch_extensions``
    (``torch.utils.cpp_extension.get_default_build_root``, without importing it)."""
    return environ.get("TORCH_EXTENSIONS_DIR") or os.path.realpath(
        os.path.join(os.path.expanduser("~"), ".cache", "torch_extensions"))


@contextlib.contextmanager
def host_lock(directory: str, timeout_s: float = JIT_BUILD_TIMEOUT_S) -> Iterator[None]:
    """Hold an exclusive ``flock`` on :data:`LOCK_NAME` in ``directory`` (created if missing).

    The file is opened without following a link planted in its place.

    Raises:
        StartTimeoutError: another process held the lock for ``timeout_s``.
    """
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, LOCK_NAME)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except OSError as e:
                if e.errno not in (errno.EAGAIN, errno.EACCES):
                    raise
            if time.monotonic() >= deadline:
                raise StartTimeoutError(
                    f"waited {timeout_s:g} s (JIT_BUILD_TIMEOUT_S) for another process on this host to finish "
                    f"building a DeepSpeed op (lock {path}); if no build is running, a stuck process holds the "
                    "lock: find it with `fuser` and end it")
            time.sleep(_POLL_S)
        yield
    finally:
        os.close(fd)  # releases the lock


def _busy(directory: str) -> bool:
    """Whether some process's working directory is ``directory`` (a build's ninja or compiler runs there)."""
    target = os.path.realpath(directory)
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            with contextlib.suppress(OSError):
                if os.readlink(f"/proc/{pid}/cwd") == target:
                    return True
    return False


def clear_stale_baton(build_directory: str) -> bool:
    """Remove torch's build ``lock`` from ``build_directory`` when no build runs there; True if one was removed.

    Called with :func:`host_lock` held, so no phalanx rank on this host is building."""
    baton = os.path.join(build_directory, "lock")
    if not os.path.lexists(baton) or _busy(build_directory):
        return False
    with contextlib.suppress(FileNotFoundError):
        os.unlink(baton)
    sys.stderr.write(f"phalanx: removed {baton}, left by a DeepSpeed op build that was stopped; building again\n")
    return True


def _build_directory(op_name: str) -> str | None:
    from torch.utils import cpp_extension  # DeepSpeed is being imported: torch is loaded

    find = getattr(cpp_extension, "_get_build_directory", None)
    return find(op_name, False) if find is not None else None


def _skip_unused_shm_op(original: Callable[[], Any]) -> Callable[[], Any]:
    @functools.wraps(original)
    def build_shm_op() -> Any:
        return original() if shm_op_is_used(os.environ) else None

    return build_shm_op


def _one_build_per_host(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def jit_load(self: Any, *args: Any, **kwargs: Any) -> Any:
        with host_lock(extensions_root(os.environ)):
            directory = _build_directory(str(getattr(self, "name", "")))
            if directory is not None:
                clear_stale_baton(directory)
            return original(self, *args, **kwargs)

    return jit_load


def _wrap(owner: Any, name: str, wrapper: Callable[[Any], Any]) -> None:
    fn = getattr(owner, name, None)
    if fn is not None and not getattr(fn, _MARK, False):
        wrapped = wrapper(fn)
        setattr(wrapped, _MARK, True)
        setattr(owner, name, wrapped)


def _patch(fullname: str) -> None:
    module = sys.modules.get(fullname)
    if module is None:
        return
    if fullname == COMM_MODULE:
        _wrap(module, "build_shm_op", _skip_unused_shm_op)
    elif fullname == BUILDER_MODULE and hasattr(module, "OpBuilder"):
        _wrap(module.OpBuilder, "jit_load", _one_build_per_host)


class _AfterImport(importlib.abc.MetaPathFinder):
    """Runs :func:`_patch` right after each of DeepSpeed's two modules is executed."""

    def __init__(self) -> None:
        self._busy: set[str] = set()

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if fullname not in (COMM_MODULE, BUILDER_MODULE) or fullname in self._busy:
            return None
        self._busy.add(fullname)  # patched_spec asks sys.meta_path again, this finder included
        try:
            return dist_backend.patched_spec(fullname, lambda: _patch(fullname))
        finally:
            self._busy.discard(fullname)


def install() -> None:
    """Wrap DeepSpeed's op building in this process (now for modules already imported, else right after their
    import); idempotent."""
    for name in (COMM_MODULE, BUILDER_MODULE):
        _patch(name)
    if not any(isinstance(f, _AfterImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterImport())
