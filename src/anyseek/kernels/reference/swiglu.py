"""Pure-PyTorch twin of the fused SwiGLU kernel (`kernels.swiglu`)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def swiglu(gu: torch.Tensor) -> torch.Tensor:
    """gu [..., 2I] = [gate | up] -> silu(gate) * up [..., I], in gu's dtype."""
    gate, up = gu.chunk(2, dim=-1)
    return F.silu(gate) * up
