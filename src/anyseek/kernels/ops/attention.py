"""The Triton attention kernels as PyTorch ops: torch.library.custom_op (with fake implementations, so
torch.compile traces them without running them) wrapped in autograd Functions. Importing this module imports
Triton; the registry imports it only when the triton backend is chosen.

Shape legend: T tokens, H heads, C = N + R query/key dim, N nope dim, R rope dim, D head dim, V value dim.
"""

from __future__ import annotations

import torch

from anyseek.kernels.triton import attention as _k


def _max_len(max_seqlen: int | None, q: torch.Tensor) -> int:
    # only steers launch settings (short documents get small tiles); None: assume one long document
    return int(max_seqlen) if max_seqlen is not None else q.shape[0]


# ----------------------------------------------------------------------------------------------------------------
# MLA


@torch.library.custom_op("anyseek::mla_attention_fwd", mutates_args=())
def _mla_fwd(
    q: torch.Tensor, k_nope: torch.Tensor, k_pe: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int,
    softmax_scale: float, causal: bool,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    return _k.attention_fwd(q, k_nope, k_pe, v, cu_seqlens, max_seqlen, softmax_scale, causal, b_shared=True)


@_mla_fwd.register_fake
def _(q, k_nope, k_pe, v, cu_seqlens, max_seqlen, softmax_scale, causal):
    T, H, _ = q.shape
    return q.new_empty(T, H, v.shape[-1]), q.new_empty(H, T, dtype=torch.float32)


@torch.library.custom_op("anyseek::mla_attention_bwd", mutates_args=())
def _mla_bwd(
    do: torch.Tensor, q: torch.Tensor, k_nope: torch.Tensor, k_pe: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
    lse: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int, softmax_scale: float, causal: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """(dq, d[k_nope | v] [T, H, N + V] in one tensor, dk_pe): the model splits k_nope and v off one projection, so
    one gradient buffer spares the split's backward a concatenation (a custom op may not return aliasing views: the
    autograd Function below slices it)."""
    return _k.attention_bwd(do, q, k_nope, k_pe, v, out, lse, cu_seqlens, max_seqlen, softmax_scale, causal, True)


@_mla_bwd.register_fake
def _(do, q, k_nope, k_pe, v, out, lse, cu_seqlens, max_seqlen, softmax_scale, causal):
    T, H, C = q.shape
    return (
        q.new_empty(T, H, C),
        q.new_empty(T, H, k_nope.shape[-1] + v.shape[-1]),
        q.new_empty(T, k_pe.shape[-1]),
    )


class _MLAAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k_nope, k_pe, v, cu_seqlens, max_seqlen, softmax_scale, causal):
        out, lse = torch.ops.anyseek.mla_attention_fwd(
            q, k_nope, k_pe, v, cu_seqlens, max_seqlen, softmax_scale, causal
        )
        ctx.save_for_backward(q, k_nope, k_pe, v, out, lse, cu_seqlens)
        ctx.max_seqlen, ctx.softmax_scale, ctx.causal = max_seqlen, softmax_scale, causal
        return out

    @staticmethod
    def backward(ctx, do):
        q, k_nope, k_pe, v, out, lse, cu_seqlens = ctx.saved_tensors
        dq, dkv, dk_pe = torch.ops.anyseek.mla_attention_bwd(
            do, q, k_nope, k_pe, v, out, lse, cu_seqlens, ctx.max_seqlen, ctx.softmax_scale, ctx.causal
        )
        N = k_nope.shape[-1]
        return dq, dkv[..., :N], dk_pe, dkv[..., N:], None, None, None, None


def mla_attention(
    q_THC: torch.Tensor,
    k_nope_THN: torch.Tensor,
    k_pe_TR: torch.Tensor,
    v_THV: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int | None = None,
    softmax_scale: float | None = None,
    causal: bool = True,
) -> torch.Tensor:
    """Triton MLA attention; shapes and masking as `anyseek.kernels.mla_attention`. out [T, H, V].

    k_pe is read through a head stride of 0 (never expanded); its gradient is summed over heads in the kernel.
    max_seqlen (a host int, no sync) only picks launch settings; the tile schedule is built from cu_seqlens on the
    device."""
    k_nope_THN, k_pe_TR, v_THV = (t.to(q_THC.dtype) for t in (k_nope_THN, k_pe_TR, v_THV))  # mixed under autocast
    scale = _k.default_scale(q_THC.shape[-1], softmax_scale)
    return _MLAAttention.apply(
        q_THC, k_nope_THN, k_pe_TR, v_THV, cu_seqlens.to(torch.int32), _max_len(max_seqlen, q_THC), scale, causal
    )


# ----------------------------------------------------------------------------------------------------------------
# plain varlen attention (d_qk may differ from d_v)


@torch.library.custom_op("anyseek::varlen_attention_fwd", mutates_args=())
def _varlen_fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
    softmax_scale: float,
    causal: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    A, B = _k.split_dim(q.shape[-1])
    kb = k[..., A:] if B else None
    return _k.attention_fwd(q, k[..., :A], kb, v, cu_seqlens, max_seqlen, softmax_scale, causal, b_shared=False)


@_varlen_fwd.register_fake
def _(q, k, v, cu_seqlens, max_seqlen, softmax_scale, causal):
    T, H, _ = q.shape
    return q.new_empty(T, H, v.shape[-1]), q.new_empty(H, T, dtype=torch.float32)


@torch.library.custom_op("anyseek::varlen_attention_bwd", mutates_args=())
def _varlen_bwd(
    do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
    cu_seqlens: torch.Tensor, max_seqlen: int, softmax_scale: float, causal: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    A, B = _k.split_dim(q.shape[-1])
    kb = k[..., A:] if B else None
    dq, dk, _, dv = _k.attention_bwd(
        do, q, k[..., :A], kb, v, out, lse, cu_seqlens, max_seqlen, softmax_scale, causal, False
    )
    return dq, dk, dv


@_varlen_bwd.register_fake
def _(do, q, k, v, out, lse, cu_seqlens, max_seqlen, softmax_scale, causal):
    return q.new_empty(q.shape), q.new_empty(k.shape), q.new_empty(v.shape)


class _VarlenAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, cu_seqlens, max_seqlen, softmax_scale, causal):
        out, lse = torch.ops.anyseek.varlen_attention_fwd(q, k, v, cu_seqlens, max_seqlen, softmax_scale, causal)
        ctx.save_for_backward(q, k, v, out, lse, cu_seqlens)
        ctx.max_seqlen, ctx.softmax_scale, ctx.causal = max_seqlen, softmax_scale, causal
        return out

    @staticmethod
    def backward(ctx, do):
        q, k, v, out, lse, cu_seqlens = ctx.saved_tensors
        dq, dk, dv = torch.ops.anyseek.varlen_attention_bwd(
            do, q, k, v, out, lse, cu_seqlens, ctx.max_seqlen, ctx.softmax_scale, ctx.causal
        )
        return dq, dk, dv, None, None, None, None


def varlen_attention(
    q_THD: torch.Tensor,
    k_THD: torch.Tensor,
    v_THV: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int | None = None,
    softmax_scale: float | None = None,
    causal: bool = True,
) -> torch.Tensor:
    """Triton varlen attention, head dims up to 256 (d_qk != d_v allowed); as `anyseek.kernels.varlen_attention`."""
    k_THD, v_THV = k_THD.to(q_THD.dtype), v_THV.to(q_THD.dtype)
    scale = _k.default_scale(q_THD.shape[-1], softmax_scale)
    return _VarlenAttention.apply(
        q_THD, k_THD, v_THV, cu_seqlens.to(torch.int32), _max_len(max_seqlen, q_THD), scale, causal
    )


__all__ = ["mla_attention", "varlen_attention"]
