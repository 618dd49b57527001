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
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """q [M, N] (fp8) * s [ceil(M/bm), ceil(N/bn)] blockwise -> w [M, N] in `dtype` (math in fp32), written into
    `out` (any [M, N] view, e.g. one expert's rows of a stacked parameter) when given.

    One row of blocks at a time: the fp32 work space is bm x N, never a second [M, N] tensor, so loading an FP8
    checkpoint needs the dequantized model and little more (issue 16)."""
    if q_MN.dim() != 2:
        raise ValueError(f"FP8 weight must be 2-D, got shape {tuple(q_MN.shape)}")
    want = scale_shape(tuple(q_MN.shape), block)
    if tuple(scale_inv_mn.shape) != want:
        raise ValueError(
            f"weight_scale_inv has shape {tuple(scale_inv_mn.shape)}, expected {want} for weight "
            f"{tuple(q_MN.shape)} in {block[0]}x{block[1]} blocks"
        )
    M, N = q_MN.shape
    bm, bn = block
    if out is None:
        out = torch.empty(M, N, dtype=dtype, device=q_MN.device)
    elif tuple(out.shape) != (M, N):
        raise ValueError(f"dequantize_blockwise: out has shape {tuple(out.shape)}, the weight {(M, N)}")
    scale = scale_inv_mn.to(torch.float32)
    for i in range(want[0]):
        rows = slice(i * bm, min((i + 1) * bm, M))
        out[rows] = q_MN[rows].to(torch.float32) * scale[i].repeat_interleave(bn)[:N]
    return out


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
