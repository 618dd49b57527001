"""Pure-PyTorch twins of `kernels.low_rank_merge` (W + scale * B A, one matmul with W as its addend: the products
summed in fp32 by the matmul, rounded once to W's dtype) and `kernels.rows_product` (scale * a^T b, one matmul with
the scale as its alpha)."""

from __future__ import annotations

import torch


def low_rank_merge(W: torch.Tensor, B: torch.Tensor, A: torch.Tensor, scale: float,
                   out: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
    if out is None:
        return torch.addmm(W, B, A, alpha=scale)
    return torch.addmm(W, B, A, alpha=scale, out=out)


def rows_product(a: torch.Tensor, b: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    if scale == 1.0:
        return a.t() @ b
    return torch.addmm(b[:1, :1], a.t(), b, beta=0.0, alpha=scale)  # (beta 0: the [1, 1] addend is not read)
