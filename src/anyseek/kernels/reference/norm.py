"""Pure-PyTorch twin of the fused RMSNorm kernel (`kernels.rms_norm`): the maths of DeepSeek-V3's RMSNorm.

Shape legend: D the normalised (last) dim.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight_D: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * rms_norm(x in fp32), the normalised x rounded to x's dtype before the scale. x [..., D] -> same
    shape, dtype = the promotion of x's and weight's dtypes."""
    y = F.rms_norm(x.float(), (x.shape[-1],), eps=eps)
    return weight_D * y.to(x.dtype)


def add_rms_norm(x: torch.Tensor, y: torch.Tensor, weight_D: torch.Tensor, eps: float, copies: int = 1
                 ) -> tuple[torch.Tensor, ...]:
    """(h, rms_norm(h), ...) with h = x + y (the residual stream, in the promotion of x's and y's dtypes) and the
    normalised h given `copies` times (one per consumer; here the same tensor, whose gradients autograd sums)."""
    h = x + y
    out = rms_norm(h, weight_D, eps)
    return (h, *([out] * copies))
