"""4-bit frozen weights (NF4 codes, per-64 bf16 absmax scales) and the pure-PyTorch twins of the ops that read them.

The format (`quantize4` / `dequantize4`): each row of a linear weight W [N, K] (nn.Linear layout, K the input dim)
is cut into groups of GROUP = 64 consecutive input features; a group keeps its absmax s (rounded to bf16) and each
weight the index of the nearest of 16 NF4 levels to w / s (`nf4_levels`: normal quantiles in [-1, 1] with an
exact 0). Dequantized: w = level[code] * s, in fp32, then rounded to the compute dtype. Why NF4 at 64 with bf16
scales: `benchmarks/quant4_error.py` (docs/training.md, "4-bit frozen bases"): on heavy-tailed weights its error is
0.125 of ||W|| against int4's 0.194 at the same size; bf16 scales cost 0.25 bit a weight instead of fp32's 0.5 and
change the error by less than 1e-4.

Packing: one row of W becomes one row of bytes, [K/2 code bytes | K/64 bf16 scales as 2 bytes each] = 17K/32
bytes, a uint8 tensor [N, 17K/32] (or [E, N, 17K/32] for a stack of experts, one expert after another). Code j of a
row lies in byte j // 2, the low nibble for even j. Codes and scales in the same row: rows stay independent, so
joining two layers' weights (`model.concat.fused_linear` joins q_a|kv_a and gate|up by rows) is joining their
packed rows, as a view where they lie back to back; and a weight is quantized one tensor (or one expert) at a time,
as it is read from disk. K must be a multiple of 64.

Ops (the fallbacks of `kernels.low_rank_linear` and `kernels.lora_routed_experts` for packed weights): the weights
dequantized in PyTorch, then the computation as for bf16/fp32 weights.

Shape legend: N output features, K input features, E experts, P = 17K/32 packed bytes per row.
"""

from __future__ import annotations

import functools

import torch

GROUP = 64
PACKED_DTYPE = torch.uint8


@functools.cache
def _levels_f64() -> torch.Tensor:
    """NF4's 16 levels: 8 positive quantiles of N(0, 1) at probabilities from 0.98385 down to 1/2 (excluded), 7
    negative ones likewise, and 0, divided by the largest (so that +1 and -1 are levels: a group's absmax is exact)."""
    top = 0.5 * (1 + 0.9677)  # the outermost probability: QLoRA's choice, so that the extreme levels sit at +-1
    pos = torch.special.ndtri(torch.linspace(top, 0.5, 9, dtype=torch.float64)[:-1])
    neg = -torch.special.ndtri(torch.linspace(top, 0.5, 8, dtype=torch.float64)[:-1])
    levels = torch.cat([neg, torch.zeros(1, dtype=torch.float64), pos]).sort().values
    return levels / levels.abs().max()


def nf4_levels(device: torch.device | str = "cpu") -> torch.Tensor:
    """The 16 NF4 levels, fp32 [16], increasing; code c means levels[c]."""
    return _levels_f64().to(device=device, dtype=torch.float32)


def packed_width(in_features: int) -> int:
    """Bytes per packed row of a weight with `in_features` inputs (a multiple of GROUP)."""
    check_in_features(in_features)
    return in_features // 2 + 2 * (in_features // GROUP)


def in_features(packed: torch.Tensor) -> int:
    """K of a packed weight [..., N, 17K/32]."""
    width = packed.shape[-1]
    if packed.dtype != PACKED_DTYPE or width % 34:
        raise ValueError(f"not a packed 4-bit weight: {packed.dtype} [..., {width}] (uint8 rows of 17K/32 bytes)")
    return width // 34 * GROUP


def check_in_features(k: int, what: str = "weight") -> None:
    if k <= 0 or k % GROUP:
        raise ValueError(f"4-bit {what}: the input dim {k} must be a positive multiple of the group size {GROUP} "
                         f"(each row's scales cover {GROUP} inputs)")


def quantize4(w: torch.Tensor, rows_per_chunk: int = 4096) -> torch.Tensor:
    """W [..., N, K] (any float dtype, any device) -> packed uint8 [..., N, 17K/32] on w's device. Rows are
    independent: done `rows_per_chunk` rows at a time, so the fp32 temporaries stay small (a 16B model's expert
    stack is quantized in pieces while it loads)."""
    K = w.shape[-1]
    check_in_features(K, f"weight {tuple(w.shape)}")
    if w.is_meta:  # (a model built on meta for a memory estimate: the packed shape alone)
        return torch.empty(*w.shape[:-1], packed_width(K), dtype=PACKED_DTYPE, device="meta")
    rows = w.reshape(-1, K)
    out = torch.empty(rows.shape[0], packed_width(K), dtype=PACKED_DTYPE, device=w.device)
    levels = nf4_levels(w.device)
    mids = (levels[1:] + levels[:-1]) / 2  # decision boundaries: code = number of midpoints below w / s
    for at in range(0, rows.shape[0], rows_per_chunk):
        g = rows[at:at + rows_per_chunk].float().reshape(-1, K // GROUP, GROUP)
        scale = g.abs().amax(-1).to(torch.bfloat16)
        s = scale.float().clamp_min(torch.finfo(torch.float32).tiny)[..., None]
        codes = torch.bucketize(g / s, mids).to(torch.uint8).reshape(g.shape[0], K)
        chunk = out[at:at + rows_per_chunk]
        chunk[:, :K // 2] = codes[:, 0::2] | (codes[:, 1::2] << 4)
        chunk[:, K // 2:] = scale.view(torch.uint8).reshape(g.shape[0], -1)
    return out.reshape(*w.shape[:-1], out.shape[-1])


def codes_and_scales(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes [..., N, K] int64 in 0..15, scales fp32 [..., N, K/64]) of a packed weight."""
    K = in_features(packed)
    rows = packed.reshape(-1, packed.shape[-1])
    b = rows[:, :K // 2].long()
    codes = torch.stack([b & 15, b >> 4], dim=-1).reshape(rows.shape[0], K)
    scales = rows[:, K // 2:].contiguous().view(torch.bfloat16).float()
    lead = packed.shape[:-1]
    return codes.reshape(*lead, K), scales.reshape(*lead, K // GROUP)


def dequantize4(packed: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Packed uint8 [..., N, 17K/32] -> W [..., N, K] in `dtype` (level * scale in fp32, rounded once)."""
    codes, scales = codes_and_scales(packed)
    w = nf4_levels(packed.device)[codes].reshape(*codes.shape[:-1], -1, GROUP) * scales[..., None]
    return w.reshape(codes.shape).to(dtype)


# ---------------------------------------------------------------- the ops' twins


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    kind = x.device.type
    return torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else x.dtype


def low_rank_linear(x: torch.Tensor, W: torch.Tensor, A: torch.Tensor, B, xd: torch.Tensor | None = None,
                    scale: float = 1.0) -> torch.Tensor:  # fmt: skip
    """`kernels.low_rank_linear` for a packed W: the weight dequantized in the compute dtype for each product
    (`Quant4LowRank`: again in backward, never kept), then the bf16/fp32 matmuls."""
    from anyseek.kernels.quant4_lowrank import quant4_low_rank_linear

    return quant4_low_rank_linear(x, W, A, B, xd, scale, _mm_wt, _mm_w)


def _mm_wt(x: torch.Tensor, W: torch.Tensor) -> torch.Tensor:
    """x [N, K] @ dequant(W)^T -> [N, out] in x's dtype."""
    return x @ dequantize4(W, x.dtype).t()


def _mm_w(g: torch.Tensor, W: torch.Tensor) -> torch.Tensor:
    """g [N, out] @ dequant(W) -> [N, K] in g's dtype."""
    return g @ dequantize4(W, g.dtype)


def lora_routed_experts(x_TD, topk_ids_TK, topk_weights_TK, gate_up_EFP, down_EDP, A_gu, B_gu, A_dn, B_dn,
                        scale: float, add_TD: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
    """`kernels.lora_routed_experts` over packed stacks gate_up [E, F, 17D/32], down [E, D, 17I/32]: dequantized in
    the compute dtype, then the reference LoRA experts (`reference.moe.lora_routed_experts`)."""
    from anyseek.kernels.reference.moe import lora_routed_experts as dense

    dt = _compute_dtype(x_TD)
    return dense(x_TD, topk_ids_TK, topk_weights_TK, dequantize4(gate_up_EFP, dt), dequantize4(down_EDP, dt), A_gu,
                 B_gu, A_dn, B_dn, scale, add_TD)  # fmt: skip
