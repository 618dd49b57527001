"""Pure-PyTorch twin of the rotary kernel (`kernels.rope_rotate`): one complex multiply per pair, in fp32."""

from __future__ import annotations

import torch


def rope_rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, out: torch.Tensor | None = None,
                interleaved_in: bool = True, interleaved_out: bool = True, conj: bool = False) -> torch.Tensor:
    """As `anyseek.kernels.rope_rotate`."""
    xf = x.float()
    if interleaved_in:
        pairs = xf.unflatten(-1, (-1, 2))
    else:
        pairs = xf.unflatten(-1, (2, -1)).transpose(-1, -2)
    z = torch.view_as_complex(pairs.contiguous())
    rot = torch.complex(cos, -sin if conj else sin).view((cos.shape[0],) + (1,) * (x.dim() - 2) + (cos.shape[-1],))
    r = torch.view_as_real(z * rot)  # [..., R/2, 2]
    r = r.flatten(-2) if interleaved_out else r.transpose(-1, -2).flatten(-2)
    if out is None:
        return r.to(x.dtype)
    out.copy_(r)
    return out
