from __future__ import annotations

import queue
import socket
import struct
from collections.abc import Iterator

import pytest

from phalanx.errors import ChannelError
from phalanx.job.channel import Closed, DriverChannel, Result, Role, WorkerChannel
from phalanx.job.framing import Kind, read_frame
from phalanx.job.records import ErrorRecord, Hello, LogLine, Stream


@pytest.fixture
def channel() -> Iterator[DriverChannel]:
    ch = DriverChannel(world_size=2, payload=b"the-payload")
    yield ch
    ch.close()


def _events(ch: DriverChannel, wait_s: float = 0.3) -> list[object]:
    out: list[object] = []
    try:
        while True:
            out.append(ch.events.get(timeout=wait_s))
    except queue.Empty:
        return out


def test_authenticated_worker_gets_payload_and_its_frames_become_events(channel: DriverChannel) -> None:
    peer = WorkerChannel.connect(channel.address, channel.secret, 1, Role.WORKER, timeout_s=5)
    assert peer.payload == b"the-payload"
    peer.send(Kind.HELLO, Hello(rank=1, pid=42, host="h").encode())
    peer.send(Kind.LOG, LogLine(rank=1, stream=Stream.STDERR, text="x" * 100_000).encode())
    peer.send(Kind.RESULT, b"\x80\x05N.")
    peer.close()
    assert channel.worker_done(1, timeout_s=5)
    events = _events(channel)
    assert events[0] == Hello(rank=1, pid=42, host="h")
    assert events[1] == LogLine(rank=1, stream=Stream.STDERR, text="x" * 100_000)
    assert events[2] == Result(rank=1, value=b"\x80\x05N.")
    assert events[3] == Closed(rank=1, role=Role.WORKER)


def test_wrong_secret_is_refused_and_leaves_no_event(channel: DriverChannel) -> None:
    with pytest.raises(ChannelError, match="refused rank 0"):
        WorkerChannel.connect(channel.address, "00" * 32, 0, Role.WORKER, timeout_s=5)
    assert _events(channel) == []
    assert not channel.is_connected(0)


def _closed_by_peer(s: socket.socket) -> bool:
    try:
        return s.recv(100) == b""  # nothing sent back
    except ConnectionResetError:  # closed with our junk unread
        return True


def test_garbage_and_oversized_frames_are_dropped(channel: DriverChannel) -> None:
    host, port = channel.address.rsplit(":", 1)
    for junk in (b"GET / HTTP/1.1\r\n\r\n", struct.pack(">BQ", 2, 1 << 40), b"\xff" * 64):
        with socket.create_connection((host, int(port)), timeout=5) as s:
            assert read_frame(s, limit=64) is not None  # the nonce
            s.sendall(junk)
            s.settimeout(5)
            assert _closed_by_peer(s)
    assert _events(channel) == []
    # The channel still serves real workers afterwards.
    peer = WorkerChannel.connect(channel.address, channel.secret, 0, Role.WORKER, timeout_s=5)
    peer.close()


def test_rank_out_of_range_and_duplicate_rank_are_refused(channel: DriverChannel) -> None:
    with pytest.raises(ChannelError):
        WorkerChannel.connect(channel.address, channel.secret, 2, Role.WORKER, timeout_s=5)
    first = WorkerChannel.connect(channel.address, channel.secret, 0, Role.WORKER, timeout_s=5)
    with pytest.raises(ChannelError):
        WorkerChannel.connect(channel.address, channel.secret, 0, Role.WORKER, timeout_s=5)
    # a supervisor of the same rank is a different peer
    sup = WorkerChannel.connect(channel.address, channel.secret, 0, Role.SUPERVISOR, timeout_s=5)
    sup.close()
    first.close()


def test_frames_claiming_another_rank_are_dropped(channel: DriverChannel) -> None:
    peer = WorkerChannel.connect(channel.address, channel.secret, 0, Role.WORKER, timeout_s=5)
    peer.send(Kind.LOG, LogLine(rank=1, stream=Stream.STDOUT, text="forged").encode())
    peer.send(Kind.ERROR, ErrorRecord(rank=1, exc_type="X", message="forged", traceback="").encode())
    peer.close()
    channel.worker_done(0, 5)
    assert [e for e in _events(channel) if not isinstance(e, Closed)] == []


def test_abort_reaches_the_worker(channel: DriverChannel) -> None:
    peer = WorkerChannel.connect(channel.address, channel.secret, 0, Role.WORKER, timeout_s=5)
    channel.abort_all()
    peer.wait_for_abort()  # returns instead of blocking
    peer.close()


def test_close_ends_the_accepting_thread_and_frees_the_port() -> None:
    """Closing a listening socket alone leaves a thread blocked in accept() (and the port listening)."""
    import threading

    before = {t.ident for t in threading.enumerate() if t.name == "phalanx-channel"}
    ch = DriverChannel(world_size=1, payload=b"")
    host, port = ch.address.rsplit(":", 1)
    ch.close()
    assert {t.ident for t in threading.enumerate() if t.name == "phalanx-channel"} <= before
    with pytest.raises(OSError):
        socket.create_connection((host, int(port)), timeout=2).close()
