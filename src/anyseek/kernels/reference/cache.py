"""Pure-PyTorch twin of the latent-cache write (`kernels.mla_cache_write`): the RMSNorm of the latent, the rotary
embedding of k_pe, and the rows' copy into the cache, as three ops; the query's rotary embedding as a fourth."""

from __future__ import annotations

import torch

from anyseek.kernels.reference.norm import rms_norm
from anyseek.kernels.reference.rope import rope_rotate


def mla_cache_write(cache_NX: torch.Tensor, slots_T: torch.Tensor, kv_a_TX: torch.Tensor, weight_L: torch.Tensor,
                    eps: float, cos: torch.Tensor, sin: torch.Tensor, interleaved_in: bool,
                    q_pe_THR: torch.Tensor | None = None, q_out_THR: torch.Tensor | None = None) -> None:  # fmt: skip
    """As `anyseek.kernels.mla_cache_write`."""
    L = weight_L.shape[0]
    latent_TL = rms_norm(kv_a_TX[:, :L], weight_L, eps)
    k_pe_TR = rope_rotate(kv_a_TX[:, L:], cos, sin, interleaved_in=interleaved_in)
    cache_NX.index_copy_(0, slots_T, torch.cat([latent_TL, k_pe_TR], dim=-1).to(cache_NX.dtype))
    if q_pe_THR is not None:
        rope_rotate(q_pe_THR, cos, sin, out=q_out_THR, interleaved_in=interleaved_in)
