"""The job's torch.distributed TCPStore, hosted by the launcher (as torchrun's agent hosts it).

The listening socket is bound to port 0 *before* any worker starts, so the port is the kernel's choice and
stays ours: no free-port probe that another process can steal between probe and use (TorchDistributor's
race). ``torch`` is imported and the store started on that socket in a background thread, so the import
overlaps the workers' own start-up; workers that connect earlier wait in the socket's backlog.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
from datetime import timedelta
from typing import Any

log = logging.getLogger(__name__)


class RendezvousStore:
    """A TCPStore server on a socket this object owns.

    Args:
        world_size: number of ranks.
        bind_host: interface to listen on (loopback for local jobs, all interfaces for Spark).
        timeout_s: the store's own operation timeout (seconds).
    """

    def __init__(self, world_size: int, bind_host: str = "127.0.0.1", timeout_s: float = 1800.0) -> None:
        self._sock = socket.create_server((bind_host, 0), backlog=max(128, 4 * world_size))
        self.port: int = self._sock.getsockname()[1]
        self._host = bind_host
        self._world_size = world_size
        self._timeout_s = timeout_s
        self._store: Any = None
        self.error: BaseException | None = None
        self._ready = threading.Event()
        threading.Thread(target=self._start, name="phalanx-store", daemon=True).start()

    def _start(self) -> None:
        try:
            from torch.distributed import TCPStore

            self._store = TCPStore(
                self._host, self.port, self._world_size, True, timedelta(seconds=self._timeout_s),
                # The store closes the descriptor it is given: give it its own copy.
                wait_for_workers=False, master_listen_fd=os.dup(self._sock.fileno()),
            )
        except BaseException as e:
            log.error("could not start the rendezvous store on port %d: %s", self.port, e)
            self.error = e
        finally:
            self._ready.set()

    def wait_ready(self, timeout_s: float) -> bool:
        """True once the store runs (or failed: see :attr:`error`)."""
        return self._ready.wait(timeout_s)

    def set(self, key: str, value: str) -> None:
        """Set ``key`` in the store (the driver publishes elastic rounds this way).

        Raises:
            RuntimeError: the store is not running (see :attr:`error`).
        """
        if self._store is None:
            raise RuntimeError(f"the rendezvous store on port {self.port} is not running: {self.error}")
        self._store.set(key, value)

    def check(self, key: str) -> bool:
        """Whether ``key`` is set in the store (False while the store is not running)."""
        return self._store is not None and bool(self._store.check([key]))

    def close(self) -> None:
        """Stop the store and release the port."""
        self._ready.wait(60.0)
        self._store = None
        try:
            self._sock.close()
        except OSError:
            pass
