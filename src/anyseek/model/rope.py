"""Decoupled rotary position embedding for MLA's rope part (default RoPE and YaRN).

Positions restart at 0 in every document of a packed batch. YaRN follows DeepSeek-V3's inference code
(floor/ceil correction range, linear ramp); its softmax-scale correction lives in ModelConfig.softmax_scale and the
cos/sin factor (mscale / mscale_all_dim ratio, 1.0 for every published DeepSeek config) in `RotaryEmbedding`.

Shape legend: T tokens, H heads, R rope dim.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from anyseek import kernels
from anyseek.model.config import ModelConfig, yarn_get_mscale


def rope_inv_freq(config: ModelConfig) -> tuple[torch.Tensor, float]:
    """inv_freq [R/2] (fp32, CPU) and the cos/sin scale."""
    dim, base = config.qk_rope_head_dim, config.rope_theta
    cpu = torch.device("cpu")  # explicit: the model may be built under `with torch.device("meta")`
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32, device=cpu) / dim))
    rs = config.rope_scaling
    if rs is None:
        return inv_freq, 1.0
    factor, orig = rs["factor"], rs["original_max_position_embeddings"]
    beta_fast, beta_slow = rs.get("beta_fast") or 32, rs.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return dim * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low = max(math.floor(correction_dim(beta_fast)), 0)
    high = min(math.ceil(correction_dim(beta_slow)), dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32, device=cpu) - low) / (high - low)).clamp(0, 1)
    # ramp 0: high-frequency dims keep their frequency; ramp 1: low-frequency dims are interpolated by `factor`.
    inv_freq = inv_freq / factor * ramp + inv_freq * (1 - ramp)
    mscale, mscale_all = rs.get("mscale"), rs.get("mscale_all_dim")
    if rs.get("attention_factor") is not None:
        cos_scale = float(rs["attention_factor"])
    elif mscale and mscale_all:
        cos_scale = yarn_get_mscale(factor, mscale) / yarn_get_mscale(factor, mscale_all)
    else:
        cos_scale = yarn_get_mscale(factor)
    return inv_freq, cos_scale


class RotaryEmbedding(nn.Module):
    """cos/sin tables for given positions. No parameters or buffers (nothing in the state dict, meta-safe)."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        inv_freq, self.cos_scale = rope_inv_freq(config)
        self._inv_freq = {"cpu": inv_freq}  # per-device cache, filled lazily

    def forward(self, positions_T: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T] int -> (cos, sin), each fp32 [T, R/2]."""
        key = str(positions_T.device)
        if key not in self._inv_freq:
            self._inv_freq[key] = self._inv_freq["cpu"].to(positions_T.device)
        freqs = positions_T.float()[:, None] * self._inv_freq[key][None, :]
        return freqs.cos() * self.cos_scale, freqs.sin() * self.cos_scale


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleave: bool) -> torch.Tensor:
    """Rotate x [T, ..., R] by cos/sin [T, R/2] in fp32; returns x's dtype.

    interleave=True rotates pairs (x[2i], x[2i+1]) (DeepSeek's weight layout), False pairs (x[i], x[i+R/2]).
    Each pair is one complex number times (cos + i sin): a single complex multiply, whose backward is one more
    (on CPU 2.5x faster forward + backward than the same rotation from real slices, muls and a cat). The output
    holds the rotated pairs interleaved, (re_0, im_0, re_1, im_1, ...), whatever the input layout; q and k get the
    same layout, so q.k is unchanged.
    """
    dtype = x.dtype
    x = x.float()
    if interleave:
        pairs = x.unflatten(-1, (-1, 2))  # a view when x's last dim is contiguous
    else:
        pairs = x.unflatten(-1, (2, -1)).transpose(-1, -2)
    if pairs.stride(-1) != 1 or any(st % 2 for st in pairs.stride()[:-1]) or pairs.storage_offset() % 2:
        pairs = pairs.contiguous()  # view_as_complex needs (re, im) adjacent and complex-aligned strides
    rot = torch.complex(cos, sin).view((cos.shape[0],) + (1,) * (x.dim() - 2) + (cos.shape[-1],))
    return torch.view_as_real(torch.view_as_complex(pairs) * rot).flatten(-2).to(dtype)


class _RopeTail(torch.autograd.Function):
    """x [T, H * (N + R)] (a matmul's output) -> x itself, each head's last R dims rotated in place: nothing is
    copied but the rope part, where split + rope + cat copied the whole query each way. The backward rotates the
    incoming gradient's rope part back in place: x must feed one consumer (MLA: the attention, whose backward
    hands over a gradient of its own)."""

    @staticmethod
    def forward(ctx, x, cos, sin, heads: int, rope: int, interleave: bool):
        tail = x.view(x.shape[0], heads, -1)[..., -rope:]
        kernels.rope_rotate(tail, cos, sin, out=tail, interleaved_in=interleave)
        ctx.mark_dirty(x)
        ctx.save_for_backward(cos, sin)
        ctx.heads, ctx.rope, ctx.interleave = heads, rope, interleave
        return x

    @staticmethod
    def backward(ctx, g):
        cos, sin = ctx.saved_tensors
        g = g.contiguous()
        tail = g.view(g.shape[0], ctx.heads, -1)[..., -ctx.rope:]
        kernels.rope_rotate(tail, cos, sin, out=tail, interleaved_out=ctx.interleave, conj=True)
        return g, None, None, None, None, None


class _Rope(torch.autograd.Function):
    """`apply_rope` on x [T, R] (any row stride, e.g. a slice of a projection) into a new contiguous tensor, one
    kernel each way (`kernels.rope_rotate`)."""

    @staticmethod
    def forward(ctx, x, cos, sin, interleave: bool):
        ctx.save_for_backward(cos, sin)
        ctx.interleave = interleave
        return kernels.rope_rotate(x, cos, sin, interleaved_in=interleave)

    @staticmethod
    def backward(ctx, g):
        cos, sin = ctx.saved_tensors
        dx = kernels.rope_rotate(g.contiguous(), cos, sin, interleaved_out=ctx.interleave, conj=True)
        return dx, None, None, None


def rope_rows(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleave: bool) -> torch.Tensor:
    """`apply_rope(x, cos, sin, interleave)` for x [T, R] whose last dim is contiguous: a new contiguous tensor."""
    if cos.requires_grad or sin.requires_grad or x.stride(-1) != 1 or x.dim() != 2:
        return apply_rope(x, cos, sin, interleave).contiguous()
    return _Rope.apply(x, cos, sin, interleave)


def rope_tail_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int, rope: int, interleave: bool
               ) -> torch.Tensor:
    """x [T, H * (N + R)], contiguous, the output of a matmul with one consumer -> x, viewed as [T, H, N + R], with
    the last R dims of each head rotated as `apply_rope` rotates them, in place (see `_RopeTail`)."""
    if x.dim() != 2 or not x.is_contiguous() or x.shape[1] % heads:
        raise ValueError(f"rope_tail_: x must be a contiguous [T, H * C] tensor, got {tuple(x.shape)} for H={heads}")
    if cos.requires_grad or sin.requires_grad or x.is_leaf and x.requires_grad:  # no in-place: split, rope, cat
        x3 = x.view(x.shape[0], heads, -1)
        n = x3.shape[-1] - rope
        return torch.cat([x3[..., :n], apply_rope(x3[..., n:], cos, sin, interleave)], dim=-1).view(x.shape)
    return _RopeTail.apply(x, cos, sin, heads, rope, interleave)
