"""Timeline events (``HOROVOD_TIMELINE``): thin wrappers that cost one function call when it is off."""

from __future__ import annotations

import phalanx.timeline as timeline

NEGOTIATE = {
    "allreduce": timeline.NEGOTIATE_ALLREDUCE, "allgather": timeline.NEGOTIATE_ALLGATHER,
    "broadcast": timeline.NEGOTIATE_BROADCAST, "alltoall": timeline.NEGOTIATE_ALLTOALL,
    "reducescatter": timeline.NEGOTIATE_REDUCESCATTER, "barrier": timeline.BARRIER,
    "join": timeline.BARRIER, "optimizer step": timeline.NEGOTIATE_ALLREDUCE,
}
RUN = {
    "allreduce": timeline.ALLREDUCE, "allgather": timeline.ALLGATHER, "broadcast": timeline.BROADCAST,
    "alltoall": timeline.ALLTOALL, "reducescatter": timeline.REDUCESCATTER, "barrier": timeline.BARRIER,
    "join": timeline.BARRIER, "optimizer step": timeline.WAIT_FOR_DATA,
}


def recording() -> bool:
    """Whether a timeline is recording (callers skip building event arguments when not)."""
    return timeline.current() is not None


#: The activities that open a collective's negotiation round: phalanx's "cycle" (it has no background cycle).
_CYCLE_OPENERS = frozenset(NEGOTIATE.values()) - {timeline.BARRIER}


def begin(name: str, activity: str, args: dict[str, object] | None = None) -> None:
    """Start ``activity`` on the row ``name`` when a timeline is recording.

    A collective's negotiation (``NEGOTIATE_*``) first marks ``CYCLE_START`` when the timeline marks
    cycles (``HOROVOD_TIMELINE_MARK_CYCLES``): each negotiation round is one cycle of phalanx's engine.
    """
    tl = timeline.current()
    if tl is not None:
        if activity in _CYCLE_OPENERS:
            tl.mark_cycle()
        tl.begin(name, activity, args)


def end(name: str, activity: str) -> None:
    """Finish ``activity`` on the row ``name`` when a timeline is recording."""
    tl = timeline.current()
    if tl is not None:
        tl.end(name, activity)
