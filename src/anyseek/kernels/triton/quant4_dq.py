"""Dequantizing a tile of a 4-bit weight inside a Triton GEMM (`reference/quant4.py` gives the format).

A packed weight is uint8 rows of [K/2 code bytes | K/64 bf16 scales]; a kernel takes it twice, as the uint8 tensor
(codes) and as an int16 view of the same bytes (scales, read as raw bits and widened to fp32: exact, and no bf16
loads, which Triton's interpreter lacks), plus NF4's 16 levels (fp32 [16], `lut`). Element (o, i) of W [N, K] is
levels[code] * scale with code = byte (o, i // 2) >> 4 * (i % 2) & 15, scale = scale (o, i // 64).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from anyseek.kernels.reference.quant4 import nf4_levels


@triton.jit
def dq_tile(q_ptr, s_ptr, lut_ptr, o, i, mask, row_bytes, scale_at, GROUP: tl.constexpr):
    """W[o, i] in fp32 for broadcastable index tensors o (output feature) and i (input feature) of one weight
    (q_ptr / s_ptr: its first byte / int16; row_bytes: bytes per row; scale_at: the first scale's int16 index within a
    row, K / 4). Masked elements are 0."""
    byte = tl.load(q_ptr + o * row_bytes + i // 2, mask=mask, other=0).to(tl.int32)
    code = (byte >> ((i % 2) * 4)) & 15
    bits = tl.load(s_ptr + o * (row_bytes // 2) + scale_at + i // GROUP, mask=mask, other=0).to(tl.int32)
    scale = ((bits & 0xFFFF) << 16).to(tl.float32, bitcast=True)
    return tl.load(lut_ptr + code) * scale


@functools.cache
def nf4_lut(device: torch.device) -> torch.Tensor:
    """NF4's levels on `device` (fp32 [16]), made once per device (a kernel argument at every launch)."""
    return nf4_levels(device)
