"""``ElasticSampler``: each rank's share of the samples an epoch has not processed yet.

After a reset the world may have another size; the sampler re-splits the epoch's remaining indices
over the new ranks, so no sample is skipped and none is seen twice within an epoch after a commit.
"""

from __future__ import annotations

from collections.abc import Iterator, Sized
from typing import Any

import torch
from torch.utils.data import Sampler

from phalanx.torch import basics


class ElasticSampler(Sampler[int]):
    """Horovod's ``ElasticSampler``: record progress with :meth:`record_batch`, keep it in the state.

    Args:
        dataset: anything with ``len()``.
        shuffle: permute the indices each epoch (``seed + epoch``).
        seed: the permutation seed (same on every rank).
    """

    def __init__(self, dataset: Sized, shuffle: bool = True, seed: int = 0) -> None:
        self.dataset = dataset
        self.shuffle = shuffle
        self.seed = seed
        self.epoch = 0
        self.processed_num = 0
        self.reset()

    def set_epoch(self, epoch: int) -> None:
        """Start ``epoch``: nothing processed yet."""
        self.epoch = epoch
        self.processed_num = 0
        self.reset()

    def record_batch(self, batch_idx: int, batch_size: int) -> None:
        """Mark batch ``batch_idx`` (0-based, of this epoch) as processed on every rank."""
        self.processed_num = (batch_idx + 1) * batch_size * self.num_replicas

    def state_dict(self) -> dict[str, Any]:
        """``epoch`` and ``processed_num`` (keep it in an ``ObjectState``/``TorchState`` attribute)."""
        return {"epoch": self.epoch, "processed_num": self.processed_num}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Adopt a :meth:`state_dict`, then re-split the remaining indices."""
        self.epoch = int(state["epoch"])
        self.processed_num = int(state["processed_num"])
        self.reset()

    def reset(self) -> None:
        """Re-read rank and size (after a reset) and split the remaining indices among the ranks."""
        self.num_replicas = basics.size() if basics.is_initialized() else 1
        self.rank = basics.rank() if basics.is_initialized() else 0
        n = len(self.dataset)
        if self.shuffle:
            order = torch.randperm(n, generator=torch.Generator().manual_seed(self.seed + self.epoch)).tolist()
        else:
            order = list(range(n))
        remaining = order[self.processed_num:]
        per = -(-len(remaining) // self.num_replicas) if remaining else 0
        padded = remaining + remaining[: per * self.num_replicas - len(remaining)]
        self.indices = padded[self.rank::self.num_replicas]

    def __iter__(self) -> Iterator[int]:
        return iter(self.indices)

    def __len__(self) -> int:
        return len(self.indices)
