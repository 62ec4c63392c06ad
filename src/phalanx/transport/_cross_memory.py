"""Cross-memory attach: copy bytes straight out of a peer process's memory (``process_vm_readv``).

Linux lets a process read another's memory when it may ptrace it (same uid and, under Yama's
``ptrace_scope`` 1, only a descendant; containers may forbid it with seccomp). Whether it works here is
probed once per channel at set-up (:func:`probe`); on any failure the transport keeps its copy through the
segment. One call copies up to ``IOV_MAX``-limited ranges; a partial copy is continued, an error raises
``OSError`` with the errno (``ESRCH``: the peer is gone, ``EPERM``: not allowed, ``EFAULT``: bad range).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os
import sys


class _Iovec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


def _load(name: str = "process_vm_readv") -> object | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
        fn = getattr(libc, name)
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.POINTER(_Iovec), ctypes.c_ulong, ctypes.POINTER(_Iovec), ctypes.c_ulong,
                   ctypes.c_ulong]
    fn.restype = ctypes.c_ssize_t
    return fn


_READV = _load()
_WRITEV = _load("process_vm_writev")  # same signature: local iovecs are the source, remote the target


def supported() -> bool:
    """Whether this platform has ``process_vm_readv`` at all (Linux)."""
    return _READV is not None


def read(pid: int, local: int, remote: int, nbytes: int) -> None:
    """Copy ``nbytes`` from address ``remote`` of process ``pid`` to address ``local`` of this process.

    Raises:
        OSError: the kernel refused or failed the copy (errno as set by ``process_vm_readv``).
    """
    fn = _READV
    if fn is None:
        raise OSError(errno.ENOSYS, "process_vm_readv is not available on this platform")
    while nbytes > 0:  # iovecs per call: threads may copy at once
        got = fn(pid, ctypes.byref(_Iovec(local, nbytes)), 1, ctypes.byref(_Iovec(remote, nbytes)), 1, 0)  # type: ignore[operator]
        if got <= 0:
            err = ctypes.get_errno() if got < 0 else errno.EFAULT
            raise OSError(err, f"process_vm_readv of {nbytes} bytes from pid {pid}: {os.strerror(err)}")
        local, remote, nbytes = local + got, remote + got, nbytes - got


IOV_BATCH = 512  # iovec pairs per call (IOV_MAX is 1024 on Linux)


def readv(pid: int, pairs: list[tuple[int, int, int]]) -> None:
    """Copy several ranges of process ``pid`` at once: each pair is (local address, remote address, bytes).

    Raises:
        OSError: the kernel refused or failed a copy (as :func:`read`).
    """
    _vector(_READV, "process_vm_readv", pid, pairs)


def writev(pid: int, pairs: list[tuple[int, int, int]]) -> None:
    """Copy several local ranges into process ``pid`` at once (``process_vm_writev``): each pair is (local
    address, remote address, bytes).

    Raises:
        OSError: the kernel refused or failed a copy (as :func:`read`).
    """
    _vector(_WRITEV, "process_vm_writev", pid, pairs)


def _vector(fn: object | None, name: str, pid: int, pairs: list[tuple[int, int, int]]) -> None:
    if fn is None:
        raise OSError(errno.ENOSYS, f"{name} is not available on this platform")
    pairs = [p for p in pairs if p[2] > 0]
    while pairs:
        batch = pairs[:IOV_BATCH]
        local = (_Iovec * len(batch))(*[_Iovec(a, n) for a, _r, n in batch])
        remote = (_Iovec * len(batch))(*[_Iovec(r, n) for _a, r, n in batch])
        got = fn(pid, local, len(batch), remote, len(batch), 0)  # type: ignore[operator]
        if got <= 0:
            err = ctypes.get_errno() if got < 0 else errno.EFAULT
            raise OSError(err, f"{name} of {len(batch)} ranges with pid {pid}: {os.strerror(err)}")
        pairs = _advance(pairs, got)


def _advance(pairs: list[tuple[int, int, int]], done: int) -> list[tuple[int, int, int]]:
    """The pairs still to copy once ``done`` bytes of them were (a partial copy may end inside a pair)."""
    i = 0
    while i < len(pairs) and done >= pairs[i][2]:
        done -= pairs[i][2]
        i += 1
    rest = pairs[i:]
    if rest and done:
        a, r, n = rest[0]
        rest[0] = (a + done, r + done, n - done)
    return rest


def probe(pid: int, remote: int, expect: bytes) -> bool:
    """Whether ``len(expect)`` bytes at ``remote`` in process ``pid`` can be read and equal ``expect``."""
    buf = ctypes.create_string_buffer(len(expect))
    try:
        read(pid, ctypes.addressof(buf), remote, len(expect))
    except OSError:
        return False
    return buf.raw == expect
