"""One transport worker thread: runs shared-memory calls in issue order, off the caller's thread.

Used by the ``phalanx_shm`` torch backend (one per process group: DDP calls ``allreduce`` from its
gradient hooks and keeps computing backward while the bucket is reduced, as with gloo's own worker thread;
a synchronous call there would block backward, losing the overlap gloo gives) and by the gradient channel
when ``PHALANX_SHM_GRAD_ASYNC=1`` (gradient buckets, see ``_dispatch``).
Every rank issues a channel's calls in the same order and the worker is the channel's only user, so the
order holds across ranks. The thread blocks on its queue when idle (never spins: two ranks may share two
cores), and the channel waits it runs block on their wake-up FIFO and time out.
"""

from __future__ import annotations

import atexit
import functools
import queue
import threading
import weakref
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from phalanx.errors import ShmTransportError

GATE_CHECK_S = 0.05  # how often a worker held by an inline call checks whether its Serial was closed
_Job = tuple[Callable[[], None], Callable[[BaseException | None], None]]


class Pending:
    """The local side of one queued call: ``wait()`` returns once it ran, re-raising its exception."""

    def __init__(self) -> None:
        self._done = threading.Event()
        self.error: BaseException | None = None

    def settle(self, error: BaseException | None) -> None:
        """Record the outcome (called by the worker thread)."""
        self.error = error
        self._done.set()

    def is_completed(self) -> bool:
        """Whether the call has run (successfully or not)."""
        return self._done.is_set()

    def wait(self, timeout: Any = None) -> bool:
        """Block until the call ran (its channel waits are bounded by their own time-out).

        Args:
            timeout: like ``torch.distributed`` work: seconds or a ``timedelta``; None waits until done.

        Raises:
            RuntimeError: not done within ``timeout`` (as gloo's work: the stall inspector polls this way).
            BaseException: the call's own exception (e.g. ``ShmTransportError`` naming the peer that died).
        """
        if not self._done.wait(_seconds(timeout)):
            raise ShmTransportError(f"shared-memory work not completed within {timeout} (it goes on)")
        if self.error is not None:
            raise self.error
        return True


def _seconds(timeout: Any) -> float | None:
    if timeout is None:
        return None
    return timeout.total_seconds() if isinstance(timeout, timedelta) else float(timeout)


class _Inline(Pending):
    """A call that runs in the waiter's thread, once the worker has run every call queued before it."""

    def __init__(self, fn: Callable[[], None]) -> None:
        super().__init__()
        self.fn = fn
        self.reached = threading.Event()  # set by the worker: everything before this call has run

    def wait(self, timeout: Any = None) -> bool:
        """Run the call here once its turn came (see :meth:`Pending.wait`)."""
        if not self.is_completed():
            if not self.reached.wait(_seconds(timeout)):
                raise ShmTransportError(f"shared-memory work not started within {timeout} (earlier calls go on)")
            try:
                self.fn()
            except BaseException as e:  # any: re-raised below, and the worker must be released
                self.settle(e)
            else:
                self.settle(None)
        return super().wait()


class _Work(dist.Work):
    """The torch ``Work`` of one queued call: ``wait`` raises the call's error (``_create_work_from_future``'s
    ``wait`` returns True even when its future failed, so ``dist.all_reduce`` missed a dead peer)."""

    def __init__(self, fut: torch.futures.Future[list[torch.Tensor]]) -> None:
        super().__init__()
        self._fut = fut

    def wait(self, timeout: timedelta = timedelta(0)) -> bool:
        """Block until the call ran; raise its error if it failed."""
        self._fut.wait()
        return True

    def get_future(self) -> torch.futures.Future[list[torch.Tensor]]:
        """The future DDP chains its bucket callbacks on."""
        return self._fut

    def is_completed(self) -> bool:
        """Whether the call ran (successfully or not)."""
        return self._fut.done()


class Serial:
    """One daemon thread that runs queued calls in order (started on first use)."""

    def __init__(self, label: str) -> None:
        self._jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._label = label
        self._thread: threading.Thread | None = None
        self._closing = False  # set by close(): an inline call nobody waits for no longer holds the queue

    def call(self, fn: Callable[[], None], inline: bool = False) -> Pending:
        """Queue ``fn``; the returned :class:`Pending` completes when it ran.

        Args:
            fn: the call.
            inline: run ``fn`` in the thread that waits for it (once the calls queued before it have run;
                the calls queued after it wait for it): no hand-over between threads, for a call whose
                caller waits for it soon anyway.
        """
        if inline:
            gate = _Inline(fn)
            self._put(functools.partial(self._gate, gate), lambda _e: None)
            return gate
        pending = Pending()
        self._put(fn, pending.settle)
        return pending

    def _gate(self, gate: _Inline) -> None:
        gate.reached.set()
        while not gate.is_completed() and not self._closing:
            gate._done.wait(GATE_CHECK_S)

    def submit(self, fn: Callable[[], None], result: list[torch.Tensor]) -> Any:
        """Queue ``fn``; the returned torch ``Work`` completes with ``result`` (or ``fn``'s exception)."""
        fut: torch.futures.Future[list[torch.Tensor]] = torch.futures.Future()

        def settle(error: BaseException | None) -> None:
            if error is not None:
                fut.set_exception(error)  # type: ignore[arg-type]  # torch's stub types it as the result
            else:
                fut.set_result(result)

        self._put(fn, settle)
        return _Work(fut)

    def _put(self, fn: Callable[[], None], settle: Callable[[BaseException | None], None]) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name=f"{self._label} worker", daemon=True)
            self._thread.start()
            _LIVE.add(self)
        self._jobs.put((fn, settle))

    def close(self, timeout_s: float | None = None) -> bool:
        """Let the thread end once the calls queued before this one are done.

        Args:
            timeout_s: wait at most this long for the thread to end (None: do not wait).

        Returns:
            Whether the thread has ended (or never started); always True when not waiting.
        """
        thread = self._thread
        if thread is None:
            return True
        if not self._closing:
            self._closing = True
            self._jobs.put(None)
        if timeout_s is None:
            return True
        thread.join(timeout_s)
        return not thread.is_alive()

    def join(self, timeout_s: float) -> None:
        """Close, and wait up to ``timeout_s`` for the thread to end."""
        self.close(timeout_s)

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            fn, settle = job
            try:
                fn()
            except BaseException as e:  # any: an unsettled call would hang its waiter
                settle(e)
            else:
                settle(None)


_LIVE: weakref.WeakSet[Serial] = weakref.WeakSet()
EXIT_JOIN_S = 5.0


@atexit.register
def _join_at_exit() -> None:
    """End the worker threads before the interpreter finalizes.

    A daemon thread still returning from ``Future.set_result`` (C++, through pybind) when finalization
    starts is ended by ``pthread_exit``, whose unwinding through a ``noexcept`` C++ frame aborts the
    process ("terminate called without an active exception", SIGABRT at exit).
    """
    for serial in list(_LIVE):
        serial.join(EXIT_JOIN_S)
