"""Issue 32, item 1: another local user holds 200 idle connections open to each of the job's ports and
reopens every one that is closed; a 2-rank job must still start within 2 s (it took 10-20 s, or failed)."""

from __future__ import annotations

import os
import selectors
import socket
import time
import traceback
from collections.abc import Callable, Iterator

import pytest

import phalanx
from phalanx.job import auth_server, channel, store
from phalanx.launch import warm

pytestmark = [pytest.mark.multiprocess]

IDLE_PER_PORT = 200
START_BOUND_S = 2.0  # the bound
NOBODY = 65534


class _Attacker:
    """Per port read from ``ports_r``: opens IDLE_PER_PORT connections, says so on ``ready_w``, and from
    then on reopens every one the server closes; never sends a byte. Ends when ``ports_r`` closes."""

    def __init__(self, ports_r: int, ready_w: int) -> None:
        self.ports_r, self.ready_w = ports_r, ready_w
        self.sel = selectors.DefaultSelector()
        self.sel.register(ports_r, selectors.EVENT_READ, None)

    def run(self) -> None:
        while True:
            for key, _ in self.sel.select():
                if key.data is not None:
                    self.reopen_if_closed(key)
                elif not self.attack_next_port():
                    return

    def attack_next_port(self) -> bool:
        raw = os.read(self.ports_r, 4)
        if len(raw) < 4:
            return False
        for _ in range(IDLE_PER_PORT):
            self.open_one(int.from_bytes(raw, "big"))
        os.write(self.ready_w, b"r")
        return True

    def open_one(self, port: int) -> None:
        try:
            s = socket.create_connection(("127.0.0.1", port), timeout=1)
        except OSError:  # the job is over
            return
        s.setblocking(False)
        self.sel.register(s, selectors.EVENT_READ, port)

    def reopen_if_closed(self, key: selectors.SelectorKey) -> None:
        sock = key.fileobj
        assert isinstance(sock, socket.socket)
        try:
            closed = sock.recv(4096) == b""
        except OSError:
            closed = True
        if closed:
            self.sel.unregister(sock)
            sock.close()
            self.open_one(key.data)


def _as_another_user() -> None:
    "127.0.0.1".encode("idna")  # imported while still readable: another user cannot read the interpreter's tree
    if os.getuid() == 0:
        os.setgid(NOBODY)
        os.setuid(NOBODY)


@pytest.fixture
def attack(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[[], list[float]]]:
    """Yields a switch: once called, every server a job builds is attacked before it serves the ranks; the
    switch returns the times (monotonic) each attack was in place."""
    ports_r, ports_w = os.pipe()
    ready_r, ready_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            os.close(ports_w)
            os.close(ready_r)
            _as_another_user()
            _Attacker(ports_r, ready_w).run()
            code = 0
        except BaseException:
            traceback.print_exc()
        finally:
            os._exit(code)
    os.close(ports_r)
    os.close(ready_w)
    in_place: list[float] = []

    class Attacked(auth_server.AuthServer):
        def __init__(self, *args: object, **kwargs: object) -> None:
            super().__init__(*args, **kwargs)  # type: ignore[arg-type]
            os.write(ports_w, self.port.to_bytes(4, "big"))
            assert os.read(ready_r, 1) == b"r"
            in_place.append(time.monotonic())

    def begin() -> list[float]:
        monkeypatch.setattr(channel, "AuthServer", Attacked)
        monkeypatch.setattr(store, "AuthServer", Attacked)
        return in_place

    try:
        yield begin
    finally:
        os.close(ports_w)
        os.close(ready_r)
        os.waitpid(pid, 0)


def _started() -> float:
    import torch

    import phalanx.torch as hvd

    hvd.init()
    hvd.allreduce(torch.ones(1), name="started")
    return time.monotonic()


@pytest.mark.timeout(180)
def test_a_job_starts_within_2_s_under_200_idle_connections_per_port(
        attack: Callable[[], list[float]]) -> None:
    """The attack may cost the start at most START_BOUND_S over the same warm job unattacked (on a quiet
    host that is the issue's "within 2 s"; a loaded 2-core host's own start time is not the attack's)."""
    if warm.ready_template(timeout_s=0) is None:  # an earlier test of the tier may have warmed it
        phalanx.run(_started, np=2)
    assert warm.ready_template(timeout_s=120) is not None  # both measured jobs fork their ranks warm
    t0 = time.monotonic()
    baseline = max(phalanx.run(_started, np=2)) - t0
    in_place = attack()
    started = phalanx.run(_started, np=2)
    assert len(in_place) == 2  # the channel and the store were both attacked
    took = max(started) - in_place[-1]
    assert took < baseline + START_BOUND_S, (
        f"the job started {took:.2f} s after the attack was in place ({baseline:.2f} s unattacked)")
