"""Horovod's activity names, as they appear in a trace, and what each means in phalanx.

The names are Horovod's own so that people (and tools) who read Horovod timelines read ours. What each
one measures in phalanx, which has no background coordinator thread:

=========================  ==================================================================================
activity                   what phalanx records under it
=========================  ==================================================================================
NEGOTIATE_ALLREDUCE, ...   the cross-rank check of name/shape/dtype/op before a collective; a rank waits here
                           for the slowest rank, so a *short* negotiation on one rank marks the straggler
QUEUE                      a tensor or bucket waiting to be launched (e.g. a fusion bucket filling up)
MEMCPY_IN_FUSION_BUFFER    copying gradients into a fused bucket
MEMCPY_OUT_FUSION_BUFFER   copying the reduced bucket back into the gradients
ALLREDUCE, ALLGATHER, ...  the torch.distributed collective itself, launch to completion
WAIT_FOR_DATA              a caller blocked on an async handle (``synchronize``) or in ``optimizer.step()``
BARRIER                    ``hvd.barrier()``
=========================  ==================================================================================
"""

from __future__ import annotations

NEGOTIATE_ALLREDUCE = "NEGOTIATE_ALLREDUCE"
NEGOTIATE_ALLGATHER = "NEGOTIATE_ALLGATHER"
NEGOTIATE_BROADCAST = "NEGOTIATE_BROADCAST"
NEGOTIATE_ALLTOALL = "NEGOTIATE_ALLTOALL"
NEGOTIATE_REDUCESCATTER = "NEGOTIATE_REDUCESCATTER"
ALLREDUCE = "ALLREDUCE"
ALLGATHER = "ALLGATHER"
BROADCAST = "BROADCAST"
ALLTOALL = "ALLTOALL"
REDUCESCATTER = "REDUCESCATTER"
BARRIER = "BARRIER"
QUEUE = "QUEUE"
MEMCPY_IN_FUSION_BUFFER = "MEMCPY_IN_FUSION_BUFFER"
MEMCPY_OUT_FUSION_BUFFER = "MEMCPY_OUT_FUSION_BUFFER"
WAIT_FOR_DATA = "WAIT_FOR_DATA"
WAIT_FOR_OTHER_TENSOR_DATA = "WAIT_FOR_OTHER_TENSOR_DATA"

#: The instant event written by :meth:`Timeline.mark_cycle` (Horovod's name).
CYCLE_START = "CYCLE_START"

#: Activities that move a tensor's bytes: the summary reports an effective bandwidth for these only.
DATA_MOVING: frozenset[str] = frozenset(
    {
        ALLREDUCE,
        ALLGATHER,
        BROADCAST,
        ALLTOALL,
        REDUCESCATTER,
        MEMCPY_IN_FUSION_BUFFER,
        MEMCPY_OUT_FUSION_BUFFER,
    }
)

#: Every activity phalanx.torch is expected to record, in the order the picture's legend lists them.
ALL_ACTIVITIES: tuple[str, ...] = (
    NEGOTIATE_ALLREDUCE,
    NEGOTIATE_ALLGATHER,
    NEGOTIATE_BROADCAST,
    NEGOTIATE_ALLTOALL,
    NEGOTIATE_REDUCESCATTER,
    QUEUE,
    MEMCPY_IN_FUSION_BUFFER,
    ALLREDUCE,
    ALLGATHER,
    BROADCAST,
    ALLTOALL,
    REDUCESCATTER,
    MEMCPY_OUT_FUSION_BUFFER,
    WAIT_FOR_DATA,
    WAIT_FOR_OTHER_TENSOR_DATA,
    BARRIER,
)
