"""``SyncBatchNorm``: batch normalization with statistics over every rank's batch (CPU and CUDA).

The per-channel sums are reduced with the differentiable :func:`~phalanx.torch.mpi_ops.allreduce` (op
``Sum``), so autograd produces the synchronized backward pass (whose gradient reduction is that
allreduce's backward) without a hand-written kernel.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.modules.batchnorm import _BatchNorm

from phalanx.errors import InvalidArgumentError
from phalanx.torch._engine import reduce as reduction
from phalanx.torch._setup import state as _state
from phalanx.torch.mpi_ops import allreduce


class SyncBatchNorm(_BatchNorm):
    """Drop-in for ``torch.nn.BatchNorm{1,2,3}d`` that normalizes with statistics of the global batch.

    Args:
        num_features: number of channels (dim 1 of the input).
        eps: added to the variance for numerical stability.
        momentum: running statistics update factor (None: cumulative average).
        affine: learn a per-channel scale and shift.
        track_running_stats: keep running mean/variance for evaluation.
    """

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: float | None = 0.1,
                 affine: bool = True, track_running_stats: bool = True) -> None:
        super().__init__(num_features, eps, momentum, affine, track_running_stats)

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise InvalidArgumentError(f"SyncBatchNorm expects at least 2-D input (N, C, ...), got {input.dim()}-D")

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        """Normalize ``input``; in training mode with more than one rank, with global batch statistics."""
        self._check_input_dim(input)
        if not self.training or _state.topology().size == 1:
            return self._local(input)
        if self.training and self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)
        return self._synced(input)

    def _factor(self) -> float:
        if self.momentum is None:
            assert self.num_batches_tracked is not None
            return 1.0 / float(self.num_batches_tracked)
        return self.momentum

    def _local(self, input: torch.Tensor) -> torch.Tensor:
        use_batch = self.training or not self.track_running_stats
        if self.training and self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)
        momentum = self._factor() if self.training and self.track_running_stats else 0.0
        return F.batch_norm(input, self.running_mean, self.running_var, self.weight, self.bias,
                            use_batch, momentum, self.eps)

    def _synced(self, input: torch.Tensor) -> torch.Tensor:
        dims = [0, *range(2, input.dim())]
        x = input.float() if input.dtype in (torch.float16, torch.bfloat16) else input
        count = torch.tensor([x.numel() / x.shape[1]], dtype=x.dtype, device=x.device)
        stats = torch.cat([x.sum(dims), (x * x).sum(dims), count])
        total = allreduce(stats, op=reduction.Sum, name=None)
        c = self.num_features
        n = total[2 * c]
        mean = total[:c] / n
        var = (total[c : 2 * c] / n - mean * mean).clamp_min(0)
        if self.track_running_stats and self.running_mean is not None and self.running_var is not None:
            with torch.no_grad():
                m = self._factor()
                unbiased = var * (n / (n - 1).clamp_min(1))
                self.running_mean.mul_(1 - m).add_(mean.detach(), alpha=m)
                self.running_var.mul_(1 - m).add_(unbiased.detach(), alpha=m)
        shape = [1, c] + [1] * (input.dim() - 2)
        y = (x - mean.view(shape)) * torch.rsqrt(var.view(shape) + self.eps)
        if self.affine:
            y = y * self.weight.view(shape) + self.bias.view(shape)
        return y.to(input.dtype)
