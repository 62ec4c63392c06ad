"""The timeline of a ``DistributedOptimizer``'s gradients: one row per tensor, as Horovod shows them.

Horovod names each gradient's row ``allreduce.<parameter name>`` (its op prefix before the name the
optimizer gives the tensor; unnamed parameters are ``allreduce.noname.<group>.<index>`` there, so their row
is ``allreduce.allreduce.noname.0.0``, as in Horovod) and shows a fused operation on the row of every tensor
it fused. The same here, with what phalanx does per bucket:

* ``QUEUE``: from the moment a tensor's gradient is final (its hook fired on the step's last backward pass)
  until its bucket is launched: the tensor waits for the rest of its bucket (and the buckets before it);
* ``MEMCPY_IN_FUSION_BUFFER``: the bucket's copy into its flat buffer (absent when the bucket is reduced in
  place, straight from the gradients);
* ``ALLREDUCE``: the bucket's allreduce, launch to completion (the reduced gradient is a view of the buffer,
  so there is no copy out of it: no ``MEMCPY_OUT_FUSION_BUFFER``).

Negotiation is not shown per tensor: the buckets' layout is agreed once, and a step's agreement is the
``optimizer.step`` row's ``NEGOTIATE_ALLREDUCE``. Each event's args carry the tensor's ``dtype``, ``shape``,
``bytes`` and its ``bucket``.

Cost: with the timeline off, one ``timeline.current()`` call per gradient hook (~0.1 us) and per bucket
launch and wait; with it on, a clock reading per gradient and one record per bucket and activity (the writer
thread expands it into a line per tensor).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

import phalanx.timeline as timeline
from phalanx.timeline import Timeline


class GradTrace:
    """The rows and timings of one optimizer's gradient buckets.

    Args:
        names: ``id(parameter)`` -> the name the optimizer gives the parameter (Horovod's).
    """

    def __init__(self, names: dict[int, str]) -> None:
        self._names = names
        self._rows: dict[int, tuple[tuple[str, ...], tuple[dict[str, object] | None, ...]]] = {}
        self._ready: dict[int, int] = {}
        self._key = f"{id(self)}.bucket"

    def ready(self, param_id: int) -> None:
        """A gradient is final for this step (its hook fired): its ``QUEUE`` starts now (call it only while a
        timeline records: the hook tests ``timeline.current()`` itself, the cheapest test when it is off)."""
        self._ready[param_id] = timeline.clock_ns()

    def _layout(self, index: int, params: Sequence[torch.Tensor]) -> tuple[tuple[str, ...],
                                                                            tuple[dict[str, object] | None, ...]]:
        rows = self._rows.get(index)
        if rows is None:
            names = tuple(f"allreduce.{self._names[id(p)]}" for p in params)
            args = tuple({"dtype": str(p.dtype), "shape": tuple(p.shape), "bytes": p.numel() * p.element_size(),
                          "bucket": index} for p in params)
            rows = self._rows[index] = (names, args)
        return rows

    def launching(self, index: int, params: Sequence[torch.Tensor]) -> Timeline | None:
        """Bucket ``index`` is about to start: end its tensors' ``QUEUE``; the recording timeline, or None."""
        tl = timeline.current()
        if tl is None:
            self._ready.clear()
            return None
        names, args = self._layout(index, params)
        waited = [(j, self._ready.pop(id(p))) for j, p in enumerate(params) if id(p) in self._ready]
        if waited:
            tl.spans(tuple(names[j] for j, _ in waited), timeline.QUEUE, tuple(t for _, t in waited),
                     tuple(args[j] for j, _ in waited))
        return tl

    def begin(self, tl: Timeline, index: int, params: Sequence[torch.Tensor], activity: str,
              start_ns: int | None = None) -> None:
        """Start ``activity`` of bucket ``index`` on each of its tensors' rows (now, or at ``start_ns``)."""
        names, args = self._layout(index, params)
        tl.begin_all(f"{self._key}{index}", names, activity, args, start_ns)

    def end(self, index: int, activity: str) -> None:
        """Finish ``activity`` of bucket ``index`` (nothing when the timeline is off)."""
        tl = timeline.current()
        if tl is not None:
            tl.end_all(f"{self._key}{index}", activity)
