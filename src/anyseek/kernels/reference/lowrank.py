"""Pure-PyTorch twins of LoRA's two low-rank seams.

`low_rank_merge`: W + scale * B A, one matmul with W as its addend (the products summed in fp32 by the matmul,
rounded once to W's dtype); b_out: B written into its columns of a strip, zeros in the others.
`low_rank_linear`: x W^T + scale (xd A^T) B^T as written, through autograd (B's blocks padded into one [out, r]
matrix): the oracle of the `torch` backend (`kernels/torch_lowrank.py`), which never forms that B nor W's gradient
where it is not wanted.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def low_rank_merge(W: torch.Tensor, B: torch.Tensor, A: torch.Tensor, scale: float, out: torch.Tensor | None = None,
                   b_out: torch.Tensor | None = None, b_at: int = 0) -> torch.Tensor:  # fmt: skip
    if b_out is not None:  # B in its columns of the strip, zeros in the others
        b_out.zero_()
        b_out[:, b_at:b_at + B.shape[1]].copy_(B)
    if out is None:
        return torch.addmm(W, B, A, alpha=scale)
    return torch.addmm(W, B, A, alpha=scale, out=out)


def low_rank_linear(x: torch.Tensor, W: torch.Tensor, A: torch.Tensor, B, xd: torch.Tensor | None = None,
                    scale: float = 1.0) -> torch.Tensor:  # fmt: skip
    """As `kernels.low_rank_linear`: x [..., in], W [out, in], A [r, in], B [out, r] or blocks [(at, B_i), ...]."""
    kind = x.device.type
    dt = torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else x.dtype
    O, R = W.shape[0], A.shape[0]
    blocks = [(0, B)] if torch.is_tensor(B) else list(B)
    B_OR, r0 = 0, 0
    for at, b in blocks:  # each block in its rows and its rank's columns of one [out, r] matrix
        o, r = b.shape
        B_OR = B_OR + F.pad(b.to(dt), (r0, R - r0 - r, at, O - at - o))
        r0 += r
    with torch.autocast(kind, enabled=False):
        x_, xd_ = x.to(dt), (x if xd is None else xd).to(dt)
        return x_ @ W.to(dt).t() + scale * ((xd_ @ A.to(dt).t()) @ B_OR.t())
