"""Pure-PyTorch twin of `kernels.low_rank_merge`: W + scale * B A, one matmul with W as its addend (the products
summed in fp32 by the matmul, rounded once to W's dtype); b_out: B written into its columns of a strip, zeros
in the others."""

from __future__ import annotations

import torch


def low_rank_merge(W: torch.Tensor, B: torch.Tensor, A: torch.Tensor, scale: float, out: torch.Tensor | None = None,
                   b_out: torch.Tensor | None = None, b_at: int = 0) -> torch.Tensor:  # fmt: skip
    if b_out is not None:  # B in its columns of the strip, zeros in the others
        b_out.zero_()
        b_out[:, b_at:b_at + B.shape[1]].copy_(B)
    if out is None:
        return torch.addmm(W, B, A, alpha=scale)
    return torch.addmm(W, B, A, alpha=scale, out=out)
