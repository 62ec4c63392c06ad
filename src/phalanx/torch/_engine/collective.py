"""A collective's local side (``Collective``, implemented per kind in ``_collectives``) and the engine's
record of one issued collective (``Entry``). The base of the engine's modules: it imports none of them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from phalanx.torch._engine import header
from phalanx.torch._engine import speculate as speculation
from phalanx.torch.process_sets import _Groups


class Collective:
    """One collective's local side. Subclasses implement the kind-specific parts."""

    sig: header.Signature

    def aux(self) -> list[int]:
        """Auxiliary integers for the control block (alltoall splits)."""
        return []

    def payload_bytes(self) -> torch.Tensor:
        """This rank's payload as a flat uint8 tensor (a view when possible)."""
        raise NotImplementedError

    def run_inline(self, payloads: list[torch.Tensor], sigs: list[header.Signature], aux: list[list[int]]) -> None:
        """Compute the result from every rank's payload bytes (the one-round-trip path)."""
        raise NotImplementedError

    def issue(self, groups: _Groups, sigs: list[header.Signature], aux: list[list[int]]) -> None:
        """Launch the payload collective asynchronously on ``groups.data``."""
        raise NotImplementedError

    def speculative_buffer(self, key: speculation.Key) -> torch.Tensor:
        """This rank's data for a speculative allreduce predicted as ``key`` (only called when this
        collective's key equals the prediction, which only allreduce keys can)."""
        raise NotImplementedError

    def adopt(self, buffer: torch.Tensor, work: Any) -> None:
        """Take a confirmed speculative allreduce as this collective's payload."""
        raise NotImplementedError

    def is_done(self) -> bool:
        """Whether the issued payload work has completed."""
        return True

    def pending(self) -> list[Any]:
        """The issued payload works ``finish`` will wait for (the stall inspector waits for them first)."""
        return []

    def finish(self) -> Any:
        """Wait for the payload and return the result."""
        raise NotImplementedError


@dataclass
class Entry:
    """One collective this rank issued, from negotiation to its result (see ``_engine``)."""

    coll: Collective
    groups: _Groups | None
    gathered: torch.Tensor | None = None
    work: Any = None
    state: str = "negotiating"
    error: BaseException | None = None
    name: str = ""
    spec: tuple[speculation.Key, torch.Tensor, Any] | None = None
    row: str = ""
    seq: int = 0  # this collective's index among those this rank issued on its membership (stall inspector)
