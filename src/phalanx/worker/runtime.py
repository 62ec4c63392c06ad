"""Run one rank of a function job and report its outcome on the channel.

The worker never reports through its stdout: the result and any exception (type, message, full
traceback) travel as structured records. A watchdog thread ends the process when the driver aborts the
job or disappears, so no worker outlives its driver.
"""

from __future__ import annotations

import atexit
import importlib
import os
import signal
import sys
import threading
from typing import Any, NoReturn

from phalanx.env import read_contract
from phalanx.errors import ChannelError, PhalanxError
from phalanx.job import stats
from phalanx.job.channel import Role, WorkerChannel
from phalanx.job.framing import Kind
from phalanx.job.payload import dumps, load_call
from phalanx.job.records import ErrorRecord, Hello
from phalanx.worker import deepspeed_ops, dist_backend
from phalanx.worker.lifeline import die_with_parent

#: Exit code of a worker whose function raised.
EXIT_FAILED = 1
#: Exit code of a worker stopped because the driver aborted the job or went away.
EXIT_ABORTED = 143
#: Least seconds a worker waits for the driver's channel to answer.
CONNECT_TIMEOUT_S = 30.0

_channel: WorkerChannel | None = None
_finishing = threading.Event()


def current_channel() -> WorkerChannel | None:
    """The channel of this worker process, or None outside a phalanx function job."""
    return _channel


def _watchdog(channel: WorkerChannel) -> None:
    channel.wait_for_abort()
    if not _finishing.is_set():
        # The driver is gone or stopped the job: leave now, without running user atexit hooks that
        # might block in a collective.
        os._exit(EXIT_ABORTED)


def _install_compat() -> None:
    """Make ``import horovod.torch`` resolve to phalanx inside workers, and ``Trainer(strategy="horovod")`` work,
    when the compat layer exists."""
    try:
        compat = importlib.import_module("phalanx.compat")
    except ImportError:
        return
    # install_rank_hooks adds Trainer(strategy="horovod") to the aliases (phalanx.lightning.hook).
    install = getattr(compat, "install_rank_hooks", None) or getattr(compat, "install", None)
    if callable(install):
        install()


def _run(channel: WorkerChannel, rank: int) -> int:
    try:
        call = load_call(channel.payload)
        try:
            value: Any = call.fn(*call.args, **call.kwargs)
        finally:
            stats.stop_reporter()  # its last record goes before the outcome: the driver sees the final step
    except SystemExit as e:
        if e.code in (None, 0):
            value = None
        else:
            channel.send(Kind.ERROR, ErrorRecord.from_exception(rank, e).encode())
            return e.code if isinstance(e.code, int) else EXIT_FAILED
    except BaseException as e:
        # Drop this function's own frame: the report starts at the user's function (or the loader).
        tb = e.__traceback__.tb_next if e.__traceback__ is not None else None
        channel.send(Kind.ERROR, ErrorRecord.from_exception(rank, e.with_traceback(tb)).encode())
        return EXIT_FAILED
    try:
        body = dumps(value)
    except Exception as e:
        err = PhalanxError(f"rank {rank}'s return value of type {type(value).__name__} cannot be pickled: {e}")
        channel.send(Kind.ERROR, ErrorRecord.from_exception(rank, err).encode())
        return EXIT_FAILED
    channel.send(Kind.RESULT, body)
    return 0


def main() -> int:
    """Run this process's rank; returns the process exit code."""
    global _channel
    die_with_parent()
    contract = read_contract()
    rank = contract.identity.rank
    try:
        # The driver enforces the start timeout; the worker only needs to outwait a slow accept.
        timeout_s = max(contract.job.start_timeout_s, CONNECT_TIMEOUT_S)
        channel = WorkerChannel.connect(contract.job.channel, contract.job.secret, rank, Role.WORKER, timeout_s)
    except ChannelError as e:
        sys.stderr.write(f"phalanx worker rank {rank}: {e}\n")
        return EXIT_FAILED
    _channel = channel
    threading.Thread(target=_watchdog, args=(channel,), name="phalanx-watchdog", daemon=True).start()
    channel.send(Kind.HELLO, Hello(rank=rank, pid=os.getpid(), host=contract.identity.hostname).encode())
    stats.start_reporter(lambda body: channel.send(Kind.STATS, body), rank, contract.identity.hostname or None)
    _install_compat()
    dist_backend.install()
    deepspeed_ops.install()
    try:
        code = _run(channel, rank)
    finally:
        _finishing.set()
        sys.stdout.flush()
        sys.stderr.flush()
        channel.close()
    return code


def leave(code: int, killed_by: int | None = None) -> NoReturn:
    """End the worker process as an interpreter's exit does for the user's code, then stop at once
    (``killed_by``: then kill itself with that signal, as an interpreter does after an uncaught
    ``KeyboardInterrupt``).

    Non-daemon threads are joined and atexit hooks run (the user's, a timeline's stop, TensorFlow's
    temporary files), and the output is flushed, but the interpreter's teardown of every module is
    skipped: with torch imported it is most of a rank's exit time, the driver waits for the exit, and
    nothing of the job lives in it. A warm-started rank ends the same way (:mod:`phalanx.worker.template`).
    """
    shutdown = getattr(threading, "_shutdown", None)  # what the interpreter calls first at exit
    if callable(shutdown):
        shutdown()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError, AttributeError):  # closed or replaced by the user's code
            pass
    if killed_by is not None:
        signal.signal(killed_by, signal.SIG_DFL)
        os.kill(os.getpid(), killed_by)
    os._exit(code)
