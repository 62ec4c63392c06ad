"""The mutual HMAC handshake every phalanx connection starts with (the channel and the store's gate).

Each side proves it holds the per-job secret by answering the other side's fresh random challenge:

1. server -> client ``NONCE``: 32 random bytes ``ns``;
2. client -> server ``AUTH``: ``rank, role, nc, HMAC(secret, "client" ‖ ns ‖ nc ‖ rank ‖ role)`` with its
   own 32 random bytes ``nc``;
3. server -> client ``PROOF``: ``HMAC(secret, "server" ‖ ns ‖ nc ‖ rank ‖ role)``.

The server answers only a valid ``AUTH`` and reads nothing larger than one ``AUTH`` frame before it; the
client reads nothing but the ``NONCE`` and the ``PROOF`` before the proof checks out, so a fake server
that lacks the secret never gets a frame of the client's unpickled. Each side's MAC covers the other's
nonce, so neither answer can be replayed into another connection, and the labels keep a client's answer
from passing as a server's. The whole exchange has one deadline, not one per ``recv``.
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
from phalanx.job.framing import FrameWriter, Kind, read_frame

NONCE_BYTES = 32
_AUTH = struct.Struct(">IB32s32s")
_MAC_BYTES = 32
#: Seconds a peer has for the whole handshake (server side: from accept to a valid ``AUTH``).
HANDSHAKE_TIMEOUT_S = 10.0


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


def serve(conn: socket.socket, secret: str, admit: Callable[[int, Role], bool],
          timeout_s: float = HANDSHAKE_TIMEOUT_S) -> tuple[int, Role] | None:
    """The server's side. Returns who the peer proved to be, or None (the caller closes the connection).

    Args:
        conn: a freshly accepted connection.
        secret: the job's secret (hex).
        admit: whether a (rank, role) may connect at all (checked before its MAC).
        timeout_s: the deadline for the whole exchange.

    Raises:
        ChannelError, OSError: the peer sent garbage, went away or missed the deadline.
    """
    deadline = time.monotonic() + timeout_s
    ns = os.urandom(NONCE_BYTES)
    conn.settimeout(timeout_s)
    writer = FrameWriter(conn)
    writer.send(Kind.NONCE, ns)
    frame = read_frame(conn, limit=_AUTH.size, deadline=deadline)
    if frame is None or frame[0] is not Kind.AUTH or len(frame[1]) != _AUTH.size:
        return None
    rank, role_raw, nc, mac = _AUTH.unpack(frame[1])
    if role_raw not in tuple(Role) or not admit(rank, Role(role_raw)):
        return None
    if not hmac.compare_digest(mac, _mac(secret, b"client", ns, nc, rank, role_raw)):
        return None
    writer.send(Kind.PROOF, _mac(secret, b"server", ns, nc, rank, role_raw))
    return rank, Role(role_raw)


def join(sock: socket.socket, secret: str, rank: int, role: Role, deadline: float, where: str) -> None:
    """The client's side: answer the server's challenge and check its proof.

    Args:
        sock: a connected socket.
        secret: the job's secret (hex).
        rank: the rank this peer speaks for.
        role: what this peer is.
        deadline: ``time.monotonic()`` by which the exchange must be over.
        where: the server's address, for messages.

    Raises:
        ChannelError: the server sent no challenge, refused us, or could not prove it holds the secret.
        OSError: the connection failed.
    """
    answer(sock, read_frame(sock, limit=NONCE_BYTES, deadline=deadline), secret, rank, role, deadline, where)


def answer(sock: socket.socket, nonce: tuple[Kind, bytes] | None, secret: str, rank: int, role: Role,
           deadline: float, where: str) -> None:
    """:func:`join` once the server's first frame (``nonce``, None if it closed) has been read."""
    if nonce is None or nonce[0] is not Kind.NONCE or len(nonce[1]) != NONCE_BYTES:
        raise ChannelError(f"the server at {where} did not send a challenge (not a phalanx job?)")
    ns, nc = nonce[1], os.urandom(NONCE_BYTES)
    FrameWriter(sock).send(Kind.AUTH, _AUTH.pack(rank, int(role), nc, _mac(secret, b"client", ns, nc, rank, role)))
    try:
        proof = read_frame(sock, limit=_MAC_BYTES, deadline=deadline)
    except ChannelError:
        proof = None
    if proof is None or proof[0] is not Kind.PROOF:
        raise ChannelError(f"the server at {where} refused rank {rank} (wrong job secret?)")
    if not hmac.compare_digest(proof[1], _mac(secret, b"server", ns, nc, rank, role)):
        raise ChannelError(
            f"the server at {where} does not hold the job's secret: it is not this job's driver, so rank "
            f"{rank} sends and accepts nothing from it"
        )
