"""The store keys of an elastic job: how the driver tells workers who is in each round.

The driver (the store's host) publishes round ``r`` by setting, in this order, every member's
assignment ``assign_key(r, worker_id) = "rank,size"``, then ``LATEST_KEY = r``, then ``round_key(r)``.
A worker waits for ``round_key(its round + 1)`` (``store.wait`` with a timeout), reads ``LATEST_KEY`` and
its assignment in that round. Pure functions, shared by ``phalanx.launch`` and ``phalanx.torch.elastic``.
"""

from __future__ import annotations

from phalanx.errors import InvalidArgumentError

#: Seconds a worker waits for the next round and for one collective, unless PHALANX_ELASTIC_TIMEOUT_S.
DEFAULT_ELASTIC_TIMEOUT_S = 60.0
PREFIX = "phalanx/elastic"
LATEST_KEY = f"{PREFIX}/latest"


def round_key(round_no: int) -> str:
    """The key whose presence says round ``round_no`` is published."""
    return f"{PREFIX}/round/{round_no}"


def assign_key(round_no: int, worker_id: int) -> str:
    """The key holding ``"rank,size"`` of ``worker_id`` in round ``round_no`` (absent: not a member)."""
    return f"{PREFIX}/{round_no}/assign/{worker_id}"


def group_prefix(round_no: int) -> str:
    """The key prefix of round ``round_no``'s process group (rounds never see each other's keys)."""
    return f"{PREFIX}/{round_no}/pg"


def synced_key(round_no: int, worker_id: int) -> str:
    """Set by a worker once it holds the job's state in round ``round_no`` (after its first sync)."""
    return f"{PREFIX}/{round_no}/synced/{worker_id}"


def encode_assignment(rank: int, size: int) -> str:
    """``"rank,size"``."""
    return f"{rank},{size}"


def decode_assignment(raw: bytes | str) -> tuple[int, int]:
    """Parse ``"rank,size"``.

    Raises:
        ValueError: malformed (the store was written by something else).
    """
    text = raw.decode() if isinstance(raw, bytes) else raw
    rank, _, size = text.partition(",")
    try:
        return int(rank), int(size)
    except ValueError as e:
        raise InvalidArgumentError(f"elastic assignment {text!r} is not 'rank,size'") from e


def round_plan(round_no: int, world: list[int]) -> list[tuple[str, str]]:
    """The (key, value) pairs that publish a round, in the order they must be set.

    Args:
        round_no: the round number (0 for the first world).
        world: worker ids in rank order.

    Returns:
        Assignments, then ``LATEST_KEY``, then the round marker.
    """
    pairs = [(assign_key(round_no, wid), encode_assignment(rank, len(world))) for rank, wid in enumerate(world)]
    return [*pairs, (LATEST_KEY, str(round_no)), (round_key(round_no), "1")]
