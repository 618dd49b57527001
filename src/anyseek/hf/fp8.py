"""Block-quantized FP8 weights as in the official DeepSeek-V3 release.

A weight w [M, N] is stored as q [M, N] float8_e4m3fn plus `weight_scale_inv` s [ceil(M/bm), ceil(N/bn)] fp32,
one scale per bm x bn block (128 x 128 in the release; blocks at the right and bottom edges are ragged):
w[i, j] ~= q[i, j] * s[i // bm, j // bn].
"""

from __future__ import annotations

import torch

DEFAULT_BLOCK = (128, 128)
FP8_MAX = 448.0  # largest finite float8_e4m3fn


def scale_shape(shape_MN: tuple[int, ...], block: tuple[int, int] = DEFAULT_BLOCK) -> tuple[int, int]:
    """Shape of the scale grid for a weight of shape [M, N]: [ceil(M/bm), ceil(N/bn)]."""
    m, n = shape_MN
    return (-(-m // block[0]), -(-n // block[1]))


def _expand(scale_mn: torch.Tensor, shape_MN: tuple[int, int], block: tuple[int, int]) -> torch.Tensor:
    """s [m, n] -> [M, N], each scale repeated over its block, cut at the ragged edges."""
    M, N = shape_MN
    return scale_mn.repeat_interleave(block[0], dim=0)[:M].repeat_interleave(block[1], dim=1)[:, :N]


def dequantize_blockwise(
    q_MN: torch.Tensor,
    scale_inv_mn: torch.Tensor,
    block: tuple[int, int] = DEFAULT_BLOCK,
    dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """q [M, N] (fp8) * s [ceil(M/bm), ceil(N/bn)] blockwise -> w [M, N] in `dtype` (math in fp32)."""
    if q_MN.dim() != 2:
        raise ValueError(f"FP8 weight must be 2-D, got shape {tuple(q_MN.shape)}")
    want = scale_shape(tuple(q_MN.shape), block)
    if tuple(scale_inv_mn.shape) != want:
        raise ValueError(
            f"weight_scale_inv has shape {tuple(scale_inv_mn.shape)}, expected {want} for weight "
            f"{tuple(q_MN.shape)} in {block[0]}x{block[1]} blocks"
        )
    w = q_MN.to(torch.float32)
    w.mul_(_expand(scale_inv_mn.to(torch.float32), tuple(q_MN.shape), block))
    return w.to(dtype)


def quantize_blockwise(w_MN: torch.Tensor, block: tuple[int, int] = DEFAULT_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """w [M, N] -> (q [M, N] float8_e4m3fn, s [ceil(M/bm), ceil(N/bn)] fp32) with each block's absmax at FP8_MAX."""
    M, N = w_MN.shape
    m, n = scale_shape((M, N), block)
    padded = torch.zeros(m * block[0], n * block[1], dtype=torch.float32, device=w_MN.device)
    padded[:M, :N] = w_MN.to(torch.float32)
    amax_mn = padded.view(m, block[0], n, block[1]).abs().amax(dim=(1, 3))
    scale_mn = (amax_mn / FP8_MAX).clamp_min(1e-12)
    q = (w_MN.to(torch.float32) / _expand(scale_mn, (M, N), block)).clamp(-FP8_MAX, FP8_MAX)
    return q.to(torch.float8_e4m3fn), scale_mn
