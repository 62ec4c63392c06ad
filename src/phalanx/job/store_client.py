"""A rank's end of the job's store (:mod:`phalanx.job.store`): a ``torch.distributed.Store``.

It connects to ``MASTER_ADDR:MASTER_PORT``, proves it holds the job's secret and checks the store's proof
(:mod:`phalanx.job.handshake`) before it sends a key. gloo, ``init_process_group`` and phalanx's own code
use it as they would use a ``TCPStore`` client. Requests on one client are serialized (as on a
``TCPStore`` client's single socket).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping
from datetime import timedelta
from typing import Any, cast

import torch.distributed as dist

from phalanx.env import names as env_names
from phalanx.env import settings
from phalanx.errors import InvalidArgumentError
from phalanx.job import handshake
from phalanx.job.framing import FrameWriter, Kind, close_socket, read_frame
from phalanx.job.store import Op, Status, pack, unpack


def _bytes(value: str | bytes) -> bytes:
    return value.encode() if isinstance(value, str) else bytes(value)


class StoreClient(dist.Store):
    """A client of the job's store.

    Args:
        host: the store's host.
        port: the store's port.
        secret: the job's secret (hex).
        rank: the rank this client speaks for (in the handshake).
        timeout: how long ``get`` and ``wait`` wait for keys, and how long to keep trying to connect.

    Raises:
        ChannelError: the store could not be reached and authenticated within ``timeout``.
    """

    def __init__(self, host: str, port: int, secret: str, rank: int, timeout: timedelta) -> None:
        super().__init__()
        self.set_timeout(timeout)
        self._where = f"{host}:{port}"
        self._lock = threading.Lock()
        self._sock = handshake.dial(host, port, secret, rank, handshake.Role.STORE,
                                    time.monotonic() + timeout.total_seconds(), "the job's store")
        self._writer = FrameWriter(self._sock)

    def _call(self, op: Op, items: list[bytes], wait: timedelta | None = None) -> list[bytes]:
        limit: timedelta = cast(Any, self).timeout if wait is None else wait  # Store.timeout: no stub
        wait_ms = max(1, int(limit.total_seconds() * 1000))
        with self._lock:
            self._writer.send(Kind.EVENT, pack(op, wait_ms, items))
            frame = read_frame(self._sock)
        if frame is None or frame[0] is not Kind.EVENT:
            raise dist.DistStoreError(f"the job's store at {self._where} closed the connection")
        status, _, reply = unpack(frame[1], request=False)
        if status == Status.TIMEOUT:
            keys = ", ".join(k.decode(errors="replace") for k in items)
            raise dist.DistStoreError(
                f"waited {limit.total_seconds():g} s for keys [{keys}] in the job's store at {self._where} "
                f"(the store's timeout: init_process_group(timeout=...))"
            )
        if status != Status.OK:
            raise InvalidArgumentError(b"".join(reply).decode(errors="replace"))
        return reply

    def set(self, key: str, value: str | bytes) -> None:
        self._call(Op.SET, [_bytes(key), _bytes(value)])

    def get(self, key: str) -> bytes:
        return self._call(Op.GET, [_bytes(key)])[0]

    def add(self, key: str, value: int) -> int:
        return int(self._call(Op.ADD, [_bytes(key), str(int(value)).encode()])[0])

    def compare_set(self, key: str, expected_value: str | bytes, desired_value: str | bytes) -> bytes:
        return self._call(Op.COMPARE_SET, [_bytes(key), _bytes(expected_value), _bytes(desired_value)])[0]

    def check(self, keys: list[str]) -> bool:
        return self._call(Op.CHECK, [_bytes(k) for k in keys])[0] == b"1"

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        self._call(Op.WAIT, [_bytes(k) for k in keys], timeout)

    def delete_key(self, key: str) -> bool:
        return self._call(Op.DELETE, [_bytes(key)])[0] == b"1"

    def num_keys(self) -> int:
        return int(self._call(Op.NUM_KEYS, [])[0])

    def append(self, key: str, value: str | bytes) -> None:
        self._call(Op.APPEND, [_bytes(key), _bytes(value)])

    def multi_get(self, keys: list[str]) -> list[bytes]:
        return self._call(Op.MULTI_GET, [_bytes(k) for k in keys])

    def multi_set(self, keys: list[str], values: list[str | bytes]) -> None:
        items: list[bytes] = []
        for key, value in zip(keys, values, strict=True):
            items += [_bytes(key), _bytes(value)]
        self._call(Op.MULTI_SET, items)

    def close(self) -> None:
        """Close the connection."""
        close_socket(self._sock)


def from_env(env: Mapping[str, str], timeout: timedelta) -> StoreClient:
    """A client of the job's store from a rank's contract variables (``MASTER_ADDR``, ``MASTER_PORT``,
    ``PHALANX_SECRET``, ``RANK``)."""
    return StoreClient(env[env_names.MASTER_ADDR], int(env[env_names.MASTER_PORT]), settings.SECRET.get(env),
                       int(env.get(env_names.RANK, "0")), timeout)
