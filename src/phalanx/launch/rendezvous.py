"""The job's rendezvous store, hosted by the launcher (as torchrun's agent hosts its TCPStore).

The store is phalanx's own (:mod:`phalanx.job.store`): a client must hold the job's secret, where torch's
``TCPStore`` answers anyone who reaches its port. Its listening socket is bound to port 0 *before* any
worker starts, so the port is the kernel's choice and stays ours: no free-port probe that another process
can steal between probe and use (TorchDistributor's race). Ranks reach it through
:class:`phalanx.job.store_client.StoreClient`, which ``init_process_group``'s ``env://`` rendezvous uses
in every rank of a phalanx job (:mod:`phalanx.worker.dist_backend`).
"""

from __future__ import annotations

from phalanx.env.shm import remove_named
from phalanx.job.store import StoreServer


class RendezvousStore:
    """The job's store, served on a socket this object owns.

    Args:
        world_size: number of ranks.
        secret: the job's secret (hex); only its holders may connect.
        bind_host: interface to listen on (loopback for local jobs, the driver's address on Spark).
    """

    def __init__(self, world_size: int, secret: str, bind_host: str = "127.0.0.1") -> None:
        self._server = StoreServer(secret, bind_host)
        self.port: int = self._server.port
        self._world_size = world_size

    def set(self, key: str, value: str) -> None:
        """Set ``key`` in the store (the driver publishes elastic rounds this way)."""
        self._server.data.set_many([(key.encode(), value.encode())])

    def check(self, key: str) -> bool:
        """Whether ``key`` is set in the store."""
        return self._server.data.has([key.encode()])

    def remove_shm_leftovers(self) -> list[str]:
        """Remove the shared-memory files the job's ranks named in the store and left behind (a rank killed
        while its group set up its transport); call once every rank has ended. Returns their names."""
        return remove_named(self._server.data.values())

    def close(self) -> None:
        """Stop the store, close every client's connection and release the port."""
        self._server.close()
