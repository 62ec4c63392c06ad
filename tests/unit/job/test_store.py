"""The job's store: TCPStore's semantics for the job's ranks, nothing at all for anyone without the secret."""

from __future__ import annotations

import os
import socket
import struct
from collections.abc import Callable, Iterator, Sequence
from datetime import timedelta

import pytest
from _users import as_nobody

from phalanx.errors import ChannelError
from phalanx.job.framing import FrameWriter, Kind, read_frame
from phalanx.job.handshake import new_secret
from phalanx.job.store import KeyValues
from phalanx.launch.rendezvous import RendezvousStore


@pytest.fixture
def store() -> Iterator[tuple[RendezvousStore, str]]:
    secret = new_secret()
    s = RendezvousStore(2, secret)
    yield s, secret
    s.close()


def _client(port: int, secret: str, timeout_s: float = 5.0) -> object:
    from phalanx.job.store_client import StoreClient

    return StoreClient("127.0.0.1", port, secret, 0, timedelta(seconds=timeout_s))


def test_the_client_has_tcpstores_semantics(store: tuple[RendezvousStore, str]) -> None:
    import torch.distributed as dist

    server, secret = store
    c: dist.Store = _client(server.port, secret)  # type: ignore[assignment]
    c.set("a", b"1")
    assert c.get("a") == b"1" and c.check(["a"]) and not c.check(["a", "b"])
    assert (c.add("n", 3), c.add("n", -1)) == (3, 2)
    assert c.compare_set("x", "", "v") == b"v"  # a missing key is set when nothing was expected
    assert c.compare_set("y", "w", "v") == b"w" and not c.check(["y"])  # ... and left alone otherwise
    assert c.compare_set("x", "v", "z") == b"z" and c.compare_set("x", "q", "r") == b"z"
    c.multi_set(["m1", "m2"], [b"1", b"2"])
    assert c.multi_get(["m1", "m2"]) == [b"1", b"2"]
    c.append("m1", b"x")
    assert c.get("m1") == b"1x" and c.delete_key("m1") and not c.delete_key("m1")
    assert c.num_keys() == 4  # a, n, x, m2
    with pytest.raises(dist.DistStoreError, match=r"waited 0.2 s for keys \[never\]"):
        c.wait(["never"], timedelta(seconds=0.2))
    prefixed = dist.PrefixStore("p", c)
    prefixed.set("k", "v")
    assert c.get("p/k") == b"v"
    assert server.check("a") and not server.check("never")
    server.set("from-driver", "d")
    assert c.get("from-driver") == b"d"


def test_a_wrong_secret_is_refused_at_once(store: tuple[RendezvousStore, str]) -> None:
    server, _ = store
    with pytest.raises(ChannelError, match="refused"):
        _client(server.port, new_secret(), timeout_s=30)


def _tcpstore_set(port: int) -> int:
    """What a torch TCPStore client sends to set a key (validate, then SET): 0 if the store never
    answered anything but its challenge."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.settimeout(10)
        first = read_frame(s, limit=64)
        if first is None or first[0] is not Kind.NONCE:
            return 1
        key, value = b"/worker/attempt_0/shm/0/attached", b"0"
        s.sendall(b"\x00" + struct.pack("<I", 0x3C85F7CE) + b"\x01" + struct.pack("<Q", len(key)) + key
                  + struct.pack("<Q", len(value)) + value)
        try:
            return 0 if s.recv(100) == b"" else 2
        except ConnectionResetError:
            return 0


def _forged_answer(port: int) -> int:
    """An answer to the challenge without the secret: 0 if the store refused it without a proof."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.settimeout(10)
        read_frame(s, limit=64)
        FrameWriter(s).send(Kind.AUTH, struct.pack(">IB32s32s", 0, 2, b"\x00" * 32, b"\x01" * 32))
        try:
            frame = read_frame(s, limit=64)
        except (ChannelError, ConnectionResetError):
            return 0
        return 0 if frame is None or frame[0] is Kind.REFUSED else 3


@pytest.mark.skipif(os.getuid() != 0, reason="becoming another local user (uid 65534) needs root")
@pytest.mark.timeout(60)
def test_another_local_user_can_neither_write_nor_read_the_store(store: tuple[RendezvousStore, str]) -> None:
    """The attack of issue 24: another user finds the store's port and rewrites the keys ranks meet by."""
    server, secret = store
    server.set("/worker/attempt_0/shm/0/attached", "2")
    assert as_nobody(lambda: _tcpstore_set(server.port)) == 0
    assert as_nobody(lambda: _forged_answer(server.port)) == 0
    c = _client(server.port, secret)
    assert c.get("/worker/attempt_0/shm/0/attached") == b"2"  # type: ignore[attr-defined]
    assert c.num_keys() == 1  # type: ignore[attr-defined]


def test_closing_the_store_ends_a_wait_in_progress_and_its_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    """A rank killed (or a job ended) while a client waits for a key: closing the store must end the wait at
    once, not after the wait's own time-out, and leave no thread serving that client."""
    import threading

    import torch.distributed as dist

    parked = threading.Event()  # the store watches the client's key: its wait is in progress
    watch = KeyValues.watch

    def watch_and_tell(self: KeyValues, keys: Sequence[bytes], fn: Callable[[], None]) -> bool:
        try:
            return watch(self, keys, fn)
        finally:
            parked.set()

    monkeypatch.setattr(KeyValues, "watch", watch_and_tell)
    secret = new_secret()
    server = RendezvousStore(2, secret)
    c: dist.Store = _client(server.port, secret, timeout_s=60.0)  # type: ignore[assignment]
    failed: list[BaseException] = []

    def wait() -> None:
        try:
            c.wait(["never"], timedelta(seconds=60))
        except BaseException as e:
            failed.append(e)

    waiter = threading.Thread(target=wait)
    waiter.start()
    assert parked.wait(30), "the client's wait did not reach the store within 30 s"
    server.close()
    waiter.join(10)
    assert not waiter.is_alive() and failed  # the client's wait failed, 10 s and not 60 s later
    assert not [t.name for t in threading.enumerate() if t.name.startswith("phalanx-store")]


def test_waiting_clients_are_parked_on_one_thread_and_woken_by_their_keys(store: tuple[RendezvousStore, str]) -> None:
    """64 clients wait for two keys at once: they hold no thread of the store's (one loop serves them all),
    another client is answered meanwhile, one key set leaves them waiting, the second wakes every one."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    import torch.distributed as dist

    server, secret = store
    clients: list[dist.Store] = [_client(server.port, secret) for _ in range(64)]  # type: ignore[misc]
    with ThreadPoolExecutor(len(clients)) as pool:
        waits = [pool.submit(c.wait, ["k1", "k2"], timedelta(seconds=30)) for c in clients]
        other: dist.Store = _client(server.port, secret)  # type: ignore[assignment]
        other.set("k1", b"1")  # answered while the others are parked
        assert other.get("k1") == b"1"
        assert not any(w.done() for w in waits)
        serving = [t.name for t in threading.enumerate()
                   if t.name.startswith("phalanx-store") and not t.name.endswith("-greet")]  # greetings end
        assert serving == ["phalanx-store"]  # the loop, not a thread per waiting client
        server.set("k2", "2")
        for w in waits:
            w.result(timeout=30)
