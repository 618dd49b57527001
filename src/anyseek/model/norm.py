"""RMSNorm as DeepSeek-V3 uses it: normalise in fp32, scale by a learned weight (init ones)."""

from __future__ import annotations

import torch
from torch import nn

from anyseek import kernels


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., dim] -> same shape, dtype the promotion of x's and the weight's; the reduction runs in fp32
        (`kernels.rms_norm`: one fused kernel each way on GPUs, F.rms_norm's chain elsewhere)."""
        return kernels.rms_norm(x, self.weight, self.eps)

    def add_forward(self, x: torch.Tensor, y: torch.Tensor, copies: int = 1) -> tuple[torch.Tensor, ...]:
        """(h, norm(h)) for the residual h = x + y: the add and the norm in one kernel each way on GPUs
        (`kernels.add_rms_norm`). copies > 1: (h, norm(h), ...) with norm(h) that many times, one per consumer, so
        that the norm's backward sums their gradients itself."""
        return kernels.add_rms_norm(x, y, self.weight, self.eps, copies)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"
