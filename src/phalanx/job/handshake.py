"""The mutual HMAC handshake every phalanx connection starts with (the channel and the store's gate).

Each side proves it holds the per-job secret by answering the other side's fresh random challenge:

1. server -> client ``NONCE``: 32 random bytes ``ns``;
2. client -> server ``AUTH``: ``rank, role, nc, HMAC(secret, "client" ‖ ns ‖ nc ‖ rank ‖ role)`` with its
   own 32 random bytes ``nc``;
3. server -> client ``PROOF``: ``HMAC(secret, "server" ‖ ns ‖ nc ‖ rank ‖ role)``, or ``REFUSED`` (empty)
   when the peer is not admitted or its MAC is wrong.

The server answers only a valid ``AUTH`` and reads nothing larger than one ``AUTH`` frame before it; the
client reads nothing but the ``NONCE`` and the ``PROOF`` before the proof checks out, so a fake server
that lacks the secret never gets a frame of the client's unpickled. Each side's MAC covers the other's
nonce, so neither answer can be replayed into another connection, and the labels keep a client's answer
from passing as a server's. The whole exchange has one deadline, not one per ``recv``.

The server's side is a few pure steps (:func:`challenge`, :func:`auth_prefix_ok`, :func:`verify`) that
:class:`phalanx.job.auth_server.AuthServer` drives without blocking; a connection the server closes before
its proof (busy, or past the deadline) is retried by the client (:func:`dial`), a ``REFUSED`` is final.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import socket
import struct
import time
from collections.abc import Callable
from enum import IntEnum

from phalanx.errors import ChannelError
from phalanx.job.framing import HEADER_BYTES, FrameWriter, Kind, close_socket, encode, parse_header, read_frame

NONCE_BYTES = 32
_AUTH = struct.Struct(">IB32s32s")
_MAC_BYTES = 32
#: Bytes of a whole ``AUTH`` frame, the most the server reads from a peer before it is authenticated.
AUTH_FRAME_BYTES = HEADER_BYTES + _AUTH.size
#: Seconds a peer has from its accept to a whole ``AUTH`` frame. A real client answers the challenge at
#: once (milliseconds, even on a loaded host its reply is one scheduling delay away); one cut off retries.
HANDSHAKE_TIMEOUT_S = 1.0
#: A client's pause before it dials a busy or unreachable server again.
DIAL_RETRY_S = 0.1


class Role(IntEnum):
    """Who an authenticated peer is: a rank's own process, a supervisor forwarding its output, or a
    relay carrying a rank's connection to the job's store (which the channel never accepts)."""

    WORKER = 0
    SUPERVISOR = 1
    STORE = 2


def new_secret() -> str:
    """A fresh per-job secret (hex, 256 bits)."""
    return secrets.token_hex(32)


def _mac(secret: str, label: bytes, ns: bytes, nc: bytes, rank: int, role: int) -> bytes:
    msg = label + ns + nc + struct.pack(">IB", rank, role)
    return hmac.new(bytes.fromhex(secret), msg, hashlib.sha256).digest()


def challenge() -> tuple[bytes, bytes]:
    """A fresh server nonce and the ``NONCE`` frame that carries it (sent at once on accept)."""
    ns = os.urandom(NONCE_BYTES)
    return ns, encode(Kind.NONCE, ns)


def auth_prefix_ok(received: bytes) -> bool:
    """Whether the bytes an unauthenticated peer sent so far can still become one ``AUTH`` frame (a
    peer whose header names another kind or size is dropped at its ninth byte)."""
    if len(received) < HEADER_BYTES:
        return True
    return parse_header(received[:HEADER_BYTES]) == (int(Kind.AUTH), _AUTH.size)


def verify(ns: bytes, frame: bytes, secret: str,
           admit: Callable[[int, Role], bool]) -> tuple[tuple[int, Role], bytes] | None:
    """The server's check of one whole ``AUTH`` frame (:data:`AUTH_FRAME_BYTES`) answering nonce ``ns``.

    Returns:
        ``((rank, role), proof)`` with the ``PROOF`` body to send back, or None: the peer is not admitted
        or does not hold the secret (send it ``REFUSED``).
    """
    if len(frame) != AUTH_FRAME_BYTES or not auth_prefix_ok(frame):
        return None
    rank, role_raw, nc, mac = _AUTH.unpack(frame[HEADER_BYTES:])
    if role_raw not in tuple(Role) or not admit(rank, Role(role_raw)):
        return None
    if not hmac.compare_digest(mac, _mac(secret, b"client", ns, nc, rank, role_raw)):
        return None
    return (rank, Role(role_raw)), _mac(secret, b"server", ns, nc, rank, role_raw)


class Dropped(ChannelError):
    """The server closed the connection before it answered: it was busy, or our answer came after its
    pre-authentication deadline (worth a retry, unlike a refusal)."""


def dial(host: str, port: int, secret: str, rank: int, role: Role, deadline: float, what: str) -> socket.socket:
    """The client's side: connect, answer the server's challenge and check its proof, retrying a server
    that is unreachable or dropped us (busy) until ``deadline``.

    Args:
        host: the server's host.
        port: the server's port.
        secret: the job's secret (hex).
        rank: the rank this peer speaks for.
        role: what this peer is.
        deadline: ``time.monotonic()`` by which the exchange must be over.
        what: the server, for messages (e.g. "the driver's channel").

    Returns:
        The authenticated socket (blocking, no timeout).

    Raises:
        ChannelError: the server refused us, could not prove it holds the secret, or could not be reached
            and authenticated before the deadline (the message names the last reason).
    """
    where, started = f"{host}:{port}", time.monotonic()
    while True:
        try:
            return _dial_once(host, port, secret, rank, role, deadline, where)
        except Dropped as e:
            last = str(e)
        except ChannelError:  # refused, or not the job's server: retrying cannot help
            raise
        except OSError as e:  # not reachable (yet)
            last = str(e)
        if time.monotonic() + DIAL_RETRY_S >= deadline:
            raise ChannelError(f"rank {rank} could not reach {what} at {where} within "
                               f"{deadline - started:.3g} s: {last}")
        time.sleep(DIAL_RETRY_S)


def _dial_once(host: str, port: int, secret: str, rank: int, role: Role, deadline: float,
               where: str) -> socket.socket:
    sock = socket.create_connection((host.strip("[]"), port), timeout=max(0.001, deadline - time.monotonic()))
    try:
        try:
            nonce = read_frame(sock, limit=NONCE_BYTES, deadline=deadline)
        except ChannelError as e:
            raise Dropped(f"no challenge from {where}: {e}") from e
        _answer(sock, nonce, secret, rank, role, deadline, where)
    except BaseException:
        close_socket(sock)
        raise
    sock.settimeout(None)
    return sock


def _answer(sock: socket.socket, nonce: tuple[Kind, bytes] | None, secret: str, rank: int, role: Role,
           deadline: float, where: str) -> None:
    """Answer the server's first frame (``nonce``, None if it closed) and check its proof.

    Raises:
        Dropped: the server closed the connection before its challenge or its proof.
        ChannelError: the server refused us or could not prove it holds the secret.
    """
    if nonce is None:
        raise Dropped(f"{where} closed the connection before its challenge (busy)")
    if nonce[0] is not Kind.NONCE or len(nonce[1]) != NONCE_BYTES:
        raise ChannelError(f"the server at {where} did not send a challenge (not a phalanx job?)")
    ns, nc = nonce[1], os.urandom(NONCE_BYTES)
    FrameWriter(sock).send(Kind.AUTH, _AUTH.pack(rank, int(role), nc, _mac(secret, b"client", ns, nc, rank, role)))
    try:
        proof = read_frame(sock, limit=_MAC_BYTES, deadline=deadline)
    except ChannelError as e:  # a frame that is no proof
        raise _impostor(where, rank) from e
    if proof is None:
        raise Dropped(f"{where} closed the connection before its proof (busy, or past its deadline)")
    if proof[0] is Kind.REFUSED:
        raise ChannelError(f"the server at {where} refused rank {rank} (wrong job secret?)")
    if proof[0] is not Kind.PROOF or not hmac.compare_digest(proof[1], _mac(secret, b"server", ns, nc, rank, role)):
        raise _impostor(where, rank)


def _impostor(where: str, rank: int) -> ChannelError:
    return ChannelError(f"the server at {where} does not hold the job's secret: it is not this job's driver, so "
                        f"rank {rank} sends and accepts nothing from it")
