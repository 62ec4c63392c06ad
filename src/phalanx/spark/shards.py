"""Which rows of a Parquet dataset each rank reads, epoch by epoch, and where an interrupted epoch resumes.

Pure arithmetic on row counts (no I/O, no NumPy beyond the seeded generator), the same on every rank.

An epoch's **order** is a list of runs ``(piece, lo, hi)``: positions ``lo..hi`` of one row group's rows,
taken in a seeded permutation of that group when rows are shuffled. With ``shuffle_row_groups`` the groups
come in an order drawn from ``(seed, epoch)``. The order depends on neither the rank nor the world size.

The **split** gives rank ``r`` of ``S`` one contiguous stretch of the order (so it reads only about its
``1/S`` of the row groups) and every rank the same number of steps: with ``T = ceil(n / (B * S))`` every
rank gets ``T - 1`` full batches and an even share of the ``R = n - (T - 1) * B * S`` rows left for the last
step; when ``R < S`` (some rank would get nothing in step ``T``) the ``R`` rows instead ride on the last
batch of ``R`` ranks (``B + 1`` rows) and the epoch has ``T - 1`` steps. Every row is in exactly one
stretch. (With fewer rows than ranks, the ranks past the last row get an empty batch in that epoch's one
step, so that every rank still takes the same steps.)

A **position** within an epoch is a list of segments ``(S, k)``: ``k`` steps taken at world size ``S``
(every rank takes the same steps). What is left after a segment is each old rank's unread tail, in rank
order; that list is split again at the next world size, so an elastic job that shrank or grew mid-epoch
reads every row of the epoch exactly once.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

Run = tuple[int, int, int]  # (piece index, lo, hi)


@dataclass(frozen=True, order=True)
class Piece:
    """One Parquet row group: the file, the group's index in it, and its row count."""

    path: str
    row_group: int
    rows: int


@dataclass(frozen=True)
class Split:
    """One world's share of a list of runs: each rank's run list and the steps every rank takes."""

    chunks: tuple[tuple[Run, ...], ...]
    sizes: tuple[int, ...]
    steps: int


def epoch_order(rows: Sequence[int], seed: int, epoch: int, shuffle_row_groups: bool) -> list[Run]:
    """The runs of an epoch: every non-empty piece whole, in a seeded order when shuffled."""
    order = (np.random.default_rng([seed, epoch]).permutation(len(rows)) if shuffle_row_groups
             else range(len(rows)))
    return [(int(i), 0, int(rows[i])) for i in order if rows[i] > 0]


def total(runs: Sequence[Run]) -> int:
    """The rows of ``runs``."""
    return sum(hi - lo for _, lo, hi in runs)


def take(runs: Sequence[Run], start: int, stop: int) -> list[Run]:
    """Rows ``start..stop`` (offsets into ``runs``) as runs."""
    out: list[Run] = []
    offset = 0
    for piece, lo, hi in runs:
        length = hi - lo
        a, b = max(start - offset, 0), min(stop - offset, length)
        if a < b:
            out.append((piece, lo + a, lo + b))
        offset += length
        if offset >= stop:
            break
    return out


def shares(rows: int, parts: int) -> list[int]:
    """``rows`` split into ``parts`` sizes differing by at most one, the larger first."""
    return [rows // parts + (1 if r < rows % parts else 0) for r in range(parts)]


def sizes_and_steps(rows: int, batch_size: int, size: int) -> tuple[list[int], int]:
    """Each rank's row count and the common step count (the module docstring's rule)."""
    if rows == 0:
        return [0] * size, 0
    steps = math.ceil(rows / (batch_size * size))
    base = (steps - 1) * batch_size
    rest = rows - base * size
    if rest < size and steps > 1:
        steps -= 1
    return [base + extra for extra in shares(rest, size)], steps


def split(runs: Sequence[Run], batch_size: int, size: int) -> Split:
    """Split ``runs`` over ``size`` ranks (the module docstring's rule)."""
    sizes, steps = sizes_and_steps(total(runs), batch_size, size)
    chunks, start = [], 0
    for rows in sizes:
        chunks.append(tuple(take(runs, start, start + rows)))
        start += rows
    return Split(tuple(chunks), tuple(sizes), steps)


def batch_sizes(rows: int, batch_size: int, steps: int) -> list[int]:
    """The sizes of a rank's ``steps`` batches over its ``rows``: full batches, the rest in the last."""
    if steps == 0:
        return []
    return [batch_size] * (steps - 1) + [rows - batch_size * (steps - 1)]


def consumed(rows: int, batch_size: int, steps: int, taken: int) -> int:
    """How many of a rank's ``rows`` its first ``taken`` steps read."""
    return rows if taken >= steps else min(rows, taken * batch_size)


def remaining(runs: Sequence[Run], segments: Sequence[tuple[int, int]], batch_size: int) -> list[Run]:
    """What is left of ``runs`` after each segment ``(size, steps taken)`` in turn."""
    left = list(runs)
    for size, taken in segments:
        share = split(left, batch_size, size)
        left = [run for rows, chunk in zip(share.sizes, share.chunks)
                for run in take(chunk, consumed(rows, batch_size, share.steps, taken), rows)]
    return left
