"""The driver's event queue: bounded, so that ranks that write faster than the driver reads slow down.

Every producer (a pipe's reader, a channel connection's reader) blocks in :meth:`EventQueue.put` while
the queue holds :data:`MAX_EVENTS` events or :data:`MAX_BYTES` bytes of text and results; the pipe or
socket it reads then fills, and the rank blocks on its next write. Nothing is dropped. One event larger
than the byte budget is let in when the queue is empty. Once the job is judged, :meth:`close` lets every
producer through without blocking (nobody reads any more).
"""

from __future__ import annotations

import queue
from typing import Any

#: Events the queue holds at most.
MAX_EVENTS = 10_000
#: Bytes of log text and results the queue holds at most.
MAX_BYTES = 32 << 20


def event_bytes(event: Any) -> int:
    """What an event weighs against :data:`MAX_BYTES`: its text or value, or a small constant."""
    for attr in ("text", "value", "body"):
        item = getattr(event, attr, None)
        if isinstance(item, (str, bytes, bytearray)):
            return len(item) + 64
    return 64


class EventQueue(queue.Queue[Any]):
    """A ``queue.Queue`` bounded by count and by bytes (see the module docstring)."""

    def __init__(self, max_events: int = MAX_EVENTS, max_bytes: int = MAX_BYTES) -> None:
        super().__init__()
        self._max_events = max_events
        self._max_bytes = max_bytes
        self._bytes = 0
        self._closed = False

    def put(self, item: Any, block: bool = True, timeout: float | None = None) -> None:
        """Add ``item``, waiting while the queue is full (unless closed).

        Raises:
            queue.Full: ``block`` is False or ``timeout`` passed and the queue is still full.
        """
        size = event_bytes(item)
        with self.not_full:
            if not self._fits(size):
                if not block:
                    raise queue.Full
                if not self.not_full.wait_for(lambda: self._fits(size), timeout):
                    raise queue.Full
            self._put(item)
            self._bytes += size
            self.unfinished_tasks += 1
            self.not_empty.notify()

    def close(self) -> None:
        """Stop blocking producers: the job is over and nobody reads the queue any more."""
        with self.not_full:
            self._closed = True
            self.not_full.notify_all()

    def _fits(self, size: int) -> bool:
        if self._closed or not self.queue:
            return True
        return len(self.queue) < self._max_events and self._bytes + size <= self._max_bytes

    def _get(self) -> Any:
        item = self.queue.popleft()
        self._bytes -= event_bytes(item)
        # Queue.get wakes one waiting producer per event. All of them (they may wait for room of different
        # sizes) only once half the room is free: waking a thousand ranks' readers for every event read
        # left the one reader of the queue a thousandth of the GIL (1,024 ranks stalled the driver).
        if len(self.queue) <= self._max_events // 2 and self._bytes <= self._max_bytes // 2:
            self.not_full.notify_all()
        return item
