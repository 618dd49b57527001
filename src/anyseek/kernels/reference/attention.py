"""Reference attention over packed variable-length batches (pure PyTorch, fp32 math).

Shape legend: T tokens in a packed batch, H heads, B documents, C = N + R query/key dim,
N nope dim, R rope dim, V value dim.
"""

from __future__ import annotations

import itertools
import math

import torch


def varlen_attention(
    q_THD: torch.Tensor,
    k_THD: torch.Tensor,
    v_THV: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int | None = None,
    softmax_scale: float | None = None,
    causal: bool = True,
    compute_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Oracle: softmax(q k^T * scale) v per document, computed in fp32, returned in q's dtype.

    q [T, H, Dqk], k [T, H, Dqk], v [T, H, Dv], cu_seqlens int [B+1] -> out [T, H, Dv].
    Attention never crosses a document boundary; with causal=True a token sees itself and earlier tokens.
    compute_dtype: tests pass the inputs' low precision to get "the same computation done by PyTorch in the
    low precision", the yardstick for a kernel's error.
    """
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q_THD.shape[-1])
    out = torch.empty(*v_THV.shape[:2], v_THV.shape[-1], dtype=q_THD.dtype, device=q_THD.device)
    bounds = cu_seqlens.tolist()
    for start, end in itertools.pairwise(bounds):
        if end == start:
            continue
        q = q_THD[start:end].to(compute_dtype).transpose(0, 1)  # (H, L, Dqk)
        k = k_THD[start:end].to(compute_dtype).transpose(0, 1)
        v = v_THV[start:end].to(compute_dtype).transpose(0, 1)
        s = torch.matmul(q, k.transpose(-1, -2)) * scale  # (H, L, L)
        if causal:
            n = end - start
            mask = torch.ones(n, n, dtype=torch.bool, device=q.device).triu_(1)
            s = s.masked_fill(mask, float("-inf"))
        p = torch.softmax(s, dim=-1)
        out[start:end] = torch.matmul(p, v).transpose(0, 1).to(out.dtype)
    return out


def mla_attention(
    q_THC: torch.Tensor,
    k_nope_THN: torch.Tensor,
    k_pe_TR: torch.Tensor,
    v_THV: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int | None = None,
    softmax_scale: float | None = None,
    causal: bool = True,
    compute_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Oracle for MLA's split form. q [T, H, N+R] (nope part first), k_nope [T, H, N],
    k_pe [T, R] shared by all heads, v [T, H, V] -> out [T, H, V]."""
    T, H, _ = q_THC.shape
    k_THC = torch.cat([k_nope_THN, k_pe_TR[:, None, :].expand(T, H, k_pe_TR.shape[-1])], dim=-1)
    return varlen_attention(q_THC, k_THC, v_THV, cu_seqlens, max_seqlen, softmax_scale, causal, compute_dtype)
