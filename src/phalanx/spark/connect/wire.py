"""What a Spark Connect job's tasks send back to the client through the query result.

Under Spark Connect the client may be unreachable from the executors, so everything the client must
learn at the end travels as the rows of the barrier ``mapInArrow`` query: every task's status, and rank
0's task's :class:`Outcome` (the ranks' raw results or the job's error, rank 0's stdout, and the log
records the client has not received live). The outcome is signed with the client's per-job secret
(HMAC-SHA256) and checked before it is unpickled, and it is cut into chunks well under Spark Connect's
Arrow batch size (``spark.connect.grpc.arrow.maxBatchSize``, 4 MiB by default) and gRPC message limit.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import pickle
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, TypedDict

from phalanx.errors import SparkJobError

if TYPE_CHECKING:
    import pyarrow as pa
    from pyspark.sql import Row

#: The query's result schema: which task, what kind of row, its order, its bytes.
SCHEMA = "rank int, kind string, seq int, data binary"
#: Bytes per row of the outcome (Spark Connect stacks rows into batches of at most 4 MiB by default).
CHUNK_BYTES = 256 << 10
STATUS = "status"
OUTCOME = "outcome"
_MAC_BYTES = 32

#: A log record: (rank, kind, text); kind "stdout"/"stderr" is a line of the rank's output, "message" a
#: ``log_to_driver`` message.
LogRecord = tuple[int, str, str]


@dataclass
class Outcome:
    """What rank 0's task returns at the end of a job.

    Attributes:
        values: every rank's raw (cloudpickled) result in rank order; None when the job failed.
        error: the job's error (a phalanx exception), pickled; None when it succeeded.
        rank0_stdout: rank 0's stdout lines (a script job's return value).
        logs: the log records the client has not received live, in arrival order.
        dropped: log records left out because the job's log exceeded the return budget.
        link: "" when the logs streamed live to the client, else why they could not.
        resets: an elastic job's re-formations.
    """

    values: list[bytes | None] | None = None
    error: bytes | None = None
    rank0_stdout: list[str] = field(default_factory=list)
    logs: list[LogRecord] = field(default_factory=list)
    dropped: int = 0
    link: str = ""
    resets: int = 0


def sign(outcome: Outcome, secret: str) -> bytes:
    """The outcome as signed bytes: HMAC-SHA256(secret, body) followed by the body."""
    body = pickle.dumps(outcome, protocol=pickle.HIGHEST_PROTOCOL)
    return hmac.new(bytes.fromhex(secret), body, hashlib.sha256).digest() + body


def verify(blob: bytes, secret: str) -> Outcome:
    """Check the signature of :func:`sign`'s bytes, then load the outcome.

    Raises:
        SparkJobError: the signature does not match (the rows were not written by this job's task).
    """
    mac, body = blob[:_MAC_BYTES], blob[_MAC_BYTES:]
    expected = hmac.new(bytes.fromhex(secret), body, hashlib.sha256).digest()
    if len(mac) != _MAC_BYTES or not hmac.compare_digest(mac, expected):
        raise SparkJobError("the outcome returned by rank 0's task does not carry this job's signature; refusing "
                            "to load it")
    outcome = pickle.loads(body)
    if not isinstance(outcome, Outcome):
        raise SparkJobError(f"rank 0's task returned a {type(outcome).__name__}, not an outcome")
    return outcome


def rows(rank: int, kind: str, data: bytes) -> Iterator[pa.RecordBatch]:
    """Arrow record batches carrying ``data`` in chunks of at most :data:`CHUNK_BYTES`."""
    import pyarrow as pa

    chunks = [data[i : i + CHUNK_BYTES] for i in range(0, len(data), CHUNK_BYTES)] or [b""]
    for seq, chunk in enumerate(chunks):
        yield pa.RecordBatch.from_pydict(
            {"rank": [rank], "kind": [kind], "seq": [seq], "data": [chunk]},
            schema=pa.schema([("rank", pa.int32()), ("kind", pa.string()), ("seq", pa.int32()),
                              ("data", pa.binary())]),
        )


class TaskStatus(TypedDict):
    """A task's status row, as :func:`status_body` writes it."""

    rank: int
    exit: int
    reported: bool
    error: str


def status_body(rank: int, returncode: int, reported: bool, error: str = "") -> bytes:
    """A task's status row: its rank, its worker's exit code, whether rank 0 heard it, its own error."""
    return json.dumps({"rank": rank, "exit": returncode, "reported": reported, "error": error}).encode()


@dataclass
class Collected:
    """The query's rows put back together: every task's status and rank 0's signed outcome (or None)."""

    statuses: list[TaskStatus]
    outcome: bytes | None


def assemble(result: Iterable[Row]) -> Collected:
    """Join the rows of the query (``Row(rank, kind, seq, data)``, any order) into statuses and outcome."""
    statuses: list[TaskStatus] = []
    parts: list[tuple[int, bytes]] = []
    for row in result:
        if row.kind == STATUS:
            statuses.append(json.loads(bytes(row.data)))
        elif row.kind == OUTCOME:
            parts.append((int(row.seq), bytes(row.data)))
    parts.sort()
    return Collected(statuses=sorted(statuses, key=lambda s: int(s["rank"])),
                     outcome=b"".join(p for _, p in parts) if parts else None)
