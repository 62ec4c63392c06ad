from __future__ import annotations

import pickle
import queue
import socket
import struct
import threading
import time
import tracemalloc
import types
from collections.abc import Callable, Iterator

import cloudpickle
import pytest
from tests.waits import wait_until

from phalanx.errors import ChannelError
from phalanx.job import auth_server
from phalanx.job import channel as channel_mod
from phalanx.job.channel import Closed, DriverChannel, Result, Role, WorkerChannel
from phalanx.job.framing import FrameWriter, Kind, read_frame
from phalanx.job.records import ErrorRecord, Hello, LogLine, Stream
from phalanx.job.spool import SPOOL_BYTES, Spooled


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


def _fake_driver(reply: Callable[[socket.socket], None]) -> tuple[str, threading.Thread]:
    """A server that sends a challenge, reads the worker's answer, then does ``reply`` (it lacks the secret)."""
    server = socket.create_server(("127.0.0.1", 0))

    def serve() -> None:
        conn, _ = server.accept()
        with conn:
            FrameWriter(conn).send(Kind.NONCE, b"\x01" * 32)
            read_frame(conn, limit=1 << 10)
            reply(conn)
            conn.recv(1)  # hold the connection until the worker gives up
        server.close()

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    return f"127.0.0.1:{server.getsockname()[1]}", t


@pytest.mark.parametrize("proof", [b"\x00" * 32, None])
def test_a_driver_without_the_secret_gets_nothing_unpickled(proof: bytes | None) -> None:
    """The worker checks the driver's proof before it reads the payload, so a fake driver's pickle is never
    read, let alone unpickled (the fake skips the proof, or forges one)."""
    bomb = pickle.dumps(_Bomb())

    def reply(conn: socket.socket) -> None:
        if proof is not None:
            FrameWriter(conn).send(Kind.PROOF, proof)
        FrameWriter(conn).send(Kind.PAYLOAD, bomb)

    address, t = _fake_driver(reply)
    with pytest.raises(ChannelError, match="secret"):
        WorkerChannel.connect(address, "ab" * 32, 0, Role.WORKER, timeout_s=5)
    t.join(5)
    assert not _Bomb.exploded


class _Bomb:
    exploded = False

    def __reduce__(self) -> tuple[object, tuple[()]]:
        return (_Bomb.explode, ())

    @staticmethod
    def explode() -> None:
        _Bomb.exploded = True


def test_the_handshake_deadline_covers_the_whole_exchange(monkeypatch: pytest.MonkeyPatch) -> None:
    """A peer that dribbles its answer a byte at a time is closed at the handshake's deadline (the timeout
    used to apply per recv, so one byte every few seconds held the connection for good)."""
    monkeypatch.setattr(channel_mod, "AUTH_TIMEOUT_S", 1.0)
    ch = DriverChannel(world_size=1, payload=b"p")
    try:
        host, port = ch.address.rsplit(":", 1)
        with socket.create_connection((host, int(port)), timeout=5) as s:
            assert read_frame(s, limit=64) is not None
            frame = struct.pack(">BQ", int(Kind.AUTH), 73) + b"\x00" * 73
            sent = 0
            with pytest.raises(OSError):  # the driver closed the connection under the dribbling peer
                for byte in frame[:40]:  # 40 bytes at 0.25 s: 10 s, ten times the deadline
                    s.sendall(bytes([byte]))
                    sent += 1
                    time.sleep(0.25)  # under test: the peer's pace, each byte within a per-recv timeout
                    s.settimeout(0.001)
                    try:
                        if s.recv(1) == b"":
                            raise ConnectionResetError("closed")
                    except TimeoutError:
                        pass
        assert sent < 40
        assert _events(ch) == []
    finally:
        ch.close()


def _idle(address: str, n: int, source: str = "127.0.0.1") -> list[socket.socket]:
    """``n`` connections from ``source`` that read the challenge and then say nothing."""
    host, port = address.rsplit(":", 1)
    out = [socket.create_connection((host, int(port)), timeout=5, source_address=(source, 0)) for _ in range(n)]
    for s in out:
        assert read_frame(s, limit=64) is not None  # each holds a pending handshake
    return out


def _dropped(s: socket.socket) -> bool:
    try:
        return s.recv(1) == b""
    except ConnectionResetError:
        return True


def test_a_full_server_drops_the_oldest_stranger_not_the_newcomer(monkeypatch: pytest.MonkeyPatch) -> None:
    """Strangers' idle connections used to fill every handshake slot for 10 s and the newest arrival was
    refused, so a real worker got in only when they all expired together (issue 32, item 1)."""
    monkeypatch.setattr(auth_server, "MAX_PENDING_HANDSHAKES", 3)
    monkeypatch.setattr(channel_mod, "AUTH_TIMEOUT_S", 60.0)  # no deadline helps here: only the bound does
    ch = DriverChannel(world_size=1, payload=b"p")
    idle = _idle(ch.address, 3)
    try:
        peer = WorkerChannel.connect(ch.address, ch.secret, 0, Role.WORKER, timeout_s=5)
        assert peer.payload == b"p"
        peer.close()
        assert _dropped(idle[0])  # the oldest made room
    finally:
        for s in idle:
            s.close()
        ch.close()


def test_one_source_over_its_bound_loses_its_own_oldest(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(auth_server, "MAX_PENDING_PER_SOURCE", 2)
    monkeypatch.setattr(channel_mod, "AUTH_TIMEOUT_S", 60.0)
    ch = DriverChannel(world_size=1, payload=b"p")
    other = _idle(ch.address, 1, source="127.0.0.1")
    strangers = _idle(ch.address, 3, source="127.0.0.2")
    try:
        assert _dropped(strangers[0])
        strangers[1].settimeout(0.3)
        other[0].settimeout(0.3)
        for s in (strangers[1], other[0]):
            with pytest.raises(TimeoutError):  # still pending
                s.recv(1)
    finally:
        for s in other + strangers:
            s.close()
        ch.close()


def test_idle_connections_are_cut_at_the_pre_auth_deadline() -> None:
    """A real client answers the challenge in milliseconds: a silent one is closed within the deadline of
    about a second (it used to hold its slot and a thread for 10 s)."""
    ch = DriverChannel(world_size=1, payload=b"p")
    (s,) = _idle(ch.address, 1)
    try:
        s.settimeout(5.0)  # a generous bound on a loaded host; the old deadline was 10 s
        assert _dropped(s)
    finally:
        s.close()
        ch.close()


def test_the_accept_loop_survives_a_thread_that_cannot_start(monkeypatch: pytest.MonkeyPatch) -> None:
    ch = DriverChannel(world_size=1, payload=b"p")
    failures = [RuntimeError("can't start new thread")]

    class Flaky(threading.Thread):
        def start(self) -> None:
            if failures:
                raise failures.pop()
            super().start()

    shim = types.SimpleNamespace(Thread=Flaky, current_thread=threading.current_thread)
    monkeypatch.setattr(auth_server, "threading", shim)
    try:  # the first authenticated peer's thread cannot start: it is dropped before its proof and retries
        peer = WorkerChannel.connect(ch.address, ch.secret, 0, Role.WORKER, timeout_s=10)
        peer.close()
        assert not failures
    finally:
        ch.close()


def test_a_large_result_is_spooled_as_it_arrives_and_loaded_once(channel: DriverChannel) -> None:
    """A result over SPOOL_BYTES goes to a file in pieces (the driver used to hold the body, the pieces it
    joined them from, then the object too); loading it allocates the object only."""
    value = bytes(range(256)) * (32 << 10)  # 8 MiB
    body = cloudpickle.dumps(value)
    peer = WorkerChannel.connect(channel.address, channel.secret, 0, Role.WORKER, timeout_s=5)
    tracemalloc.start()
    try:
        peer.send(Kind.RESULT, body)
        peer.close()
        assert channel.worker_done(0, timeout_s=10)
        result = _events(channel)[0]
        receiving = tracemalloc.get_traced_memory()[1]
        tracemalloc.reset_peak()
        assert isinstance(result, Result) and isinstance(result.value, Spooled)
        loaded = result.value.load()
        loading = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert len(result.value) == len(body) and loaded == value
    assert receiving < SPOOL_BYTES + (1 << 20), receiving  # one piece at a time, never the whole body
    assert loading < len(value) + (1 << 20), loading
    assert result.value.file.closed


def _hold_rank_0_end(monkeypatch: pytest.MonkeyPatch) -> list[Callable[[], None]]:
    """Keep the channel from being told that rank 0's connection ended (as when the loop reads another
    rank's frame first); the returned list gets the held calls, to be made at the end."""
    held: list[Callable[[], None]] = []
    ended = channel_mod._Peer.ended

    def held_end(self: channel_mod._Peer, error: BaseException | None) -> None:
        if self._who[0] == 0:
            held.append(lambda: ended(self, error))
        else:
            ended(self, error)

    monkeypatch.setattr(channel_mod._Peer, "ended", held_end)
    return held


def _rank_0_ends_then_rank_1_errs(ch: DriverChannel, held: list[Callable[[], None]]) -> WorkerChannel:
    """Rank 0 connects and ends (its end held from the channel); then rank 1 sends an error about it. Returns
    rank 1's connection, still open."""
    lost = WorkerChannel.connect(ch.address, ch.secret, 0, Role.WORKER, timeout_s=5)
    survivor = WorkerChannel.connect(ch.address, ch.secret, 1, Role.WORKER, timeout_s=5)
    lost.close()
    wait_until(lambda: held, 30, "the channel's loop read rank 0's end")
    assert ch.closed_at(0, Role.WORKER) is None
    survivor.send(Kind.ERROR, ErrorRecord(rank=1, exc_type="ConnectionError", message="peer 0 is gone",
                                          traceback="").encode())
    return survivor


def test_a_peer_that_ended_before_an_error_arrived_is_stamped_first(monkeypatch: pytest.MonkeyPatch) -> None:
    """Rank 0's process ends, then rank 1's error arrives; the loop has not yet told the channel of rank 0's
    end (held here, as the loop may read rank 1's error first when both are ready at once). Rank 0 still
    ended before the error was queued."""
    held = _hold_rank_0_end(monkeypatch)
    ch = DriverChannel(world_size=2, payload=b"p")
    try:
        survivor = _rank_0_ends_then_rank_1_errs(ch, held)  # the channel is not told of rank 0's end first
        assert isinstance(ch.events.get(timeout=5), ErrorRecord)
        assert ch.closed_at(0, Role.WORKER) is not None  # stamped before the error was queued
        survivor.close()
    finally:
        for call in held:
            call()
        ch.close()


def test_a_peer_that_ended_with_frames_unread_is_stamped_first(monkeypatch: pytest.MonkeyPatch) -> None:
    """As above, but the loop has not even read what rank 0 sent before it ended (its hello, under load): a
    look at the next byte would see the hello, not the end. The kernel still knows the peer closed."""
    read_peer = auth_server.AuthServer._read_peer
    holding = threading.Event()

    def held_read(self: auth_server.AuthServer, peer: auth_server._Peer) -> None:
        session = peer.session
        if holding.is_set() and isinstance(session, channel_mod._Peer) and session._who[0] == 0:
            time.sleep(0.001)  # leave rank 0's bytes in its socket (the selector keeps reporting them)
            return
        read_peer(self, peer)

    monkeypatch.setattr(auth_server.AuthServer, "_read_peer", held_read)
    ch = DriverChannel(world_size=2, payload=b"p")
    try:
        lost = WorkerChannel.connect(ch.address, ch.secret, 0, Role.WORKER, timeout_s=5)
        survivor = WorkerChannel.connect(ch.address, ch.secret, 1, Role.WORKER, timeout_s=5)
        holding.set()
        lost.send(Kind.HELLO, Hello(rank=0, pid=1, host="h").encode())
        lost.close()
        survivor.send(Kind.ERROR, ErrorRecord(rank=1, exc_type="ConnectionError", message="peer 0 is gone",
                                              traceback="").encode())
        assert isinstance(ch.events.get(timeout=5), ErrorRecord)
        assert ch.closed_at(0, Role.WORKER) is not None  # stamped before the error was queued
        survivor.close()
    finally:
        holding.clear()
        ch.close()


def test_the_rank_that_sent_the_error_is_not_dated_with_the_dead_one(monkeypatch: pytest.MonkeyPatch) -> None:
    """Rank 1 sends its error and ends at once, after rank 0 died: rank 1's end is dated after rank 0's, never
    tied with it (a tie would put the lower rank first, whichever died)."""
    held = _hold_rank_0_end(monkeypatch)
    ch = DriverChannel(world_size=2, payload=b"p")
    try:
        survivor = _rank_0_ends_then_rank_1_errs(ch, held)
        survivor.close()
        assert ch.worker_done(1, timeout_s=30)
        lost_at, survivor_at = ch.closed_at(0, Role.WORKER), ch.closed_at(1, Role.WORKER)
        assert lost_at is not None and survivor_at is not None and lost_at < survivor_at
    finally:
        for call in held:
            call()
        ch.close()
