"""Pure-PyTorch twin of `kernels.low_rank_merge`: W + scale * B A, one matmul with W as its addend (the products
summed in fp32 by the matmul, rounded once to W's dtype)."""

from __future__ import annotations

import torch


def low_rank_merge(W: torch.Tensor, B: torch.Tensor, A: torch.Tensor, scale: float,
                   out: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
    if out is None:
        return torch.addmm(W, B, A, alpha=scale)
    return torch.addmm(W, B, A, alpha=scale, out=out)
