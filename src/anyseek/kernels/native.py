"""Backends from native libraries, used only when installed and only for shapes they run.

flash_attn (FlashAttention-2): `flash_attn_varlen_func` for `varlen_attention` when d_qk == d_v <= 256 on an
SM80+ GPU in fp16/bf16. It is never installed by anyseek and sits after the Triton backend in priority (we have
not measured it against ours on the same card); ask for it with ANYSEEK_ATTENTION=flash_attn. MLA's 192/128 dims
would need V padded, so it is not offered for `mla_attention`.
"""

from __future__ import annotations

import importlib.util

import torch


def flash_attn_available(example: torch.Tensor) -> tuple[bool, str]:
    if importlib.util.find_spec("flash_attn") is None:
        return False, "flash_attn is not installed"
    if example.device.type != "cuda":
        return False, f"needs a CUDA GPU (tensor is on {example.device.type})"
    if example.dtype not in (torch.float16, torch.bfloat16):
        return False, f"dtype {example.dtype} not supported (fp16, bf16)"
    if example.shape[-1] > 256:
        return False, f"head dim {example.shape[-1]} > 256"
    if torch.cuda.get_device_capability(example.device)[0] < 8:
        return False, "needs compute capability 8.0 or newer"
    return True, "flash_attn_varlen_func (FlashAttention-2)"


def flash_attn_varlen_attention(
    q_THD: torch.Tensor,
    k_THD: torch.Tensor,
    v_THV: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int | None = None,
    softmax_scale: float | None = None,
    causal: bool = True,
) -> torch.Tensor:
    """`varlen_attention` through flash_attn; needs d_qk == d_v and max_seqlen."""
    from flash_attn import flash_attn_varlen_func

    if v_THV.shape[-1] != q_THD.shape[-1]:
        raise ValueError(f"flash_attn needs d_qk == d_v, got {q_THD.shape[-1]} and {v_THV.shape[-1]}")
    if max_seqlen is None:
        raise ValueError("flash_attn needs max_seqlen")
    cu = cu_seqlens.to(torch.int32)
    return flash_attn_varlen_func(
        q_THD, k_THD, v_THV, cu, cu, max_seqlen, max_seqlen, softmax_scale=softmax_scale, causal=causal
    )
