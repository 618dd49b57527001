"""Dequantizing a tile of a 4-bit weight inside a Triton GEMM (`reference/quant4.py` gives the format).

A packed weight is uint8 rows of [K/2 code bytes | K/64 bf16 scales]; a kernel takes it twice, as the uint8 tensor
(codes) and as an int16 view of the same bytes (scales, read as raw bits and widened to fp32: exact, and no bf16
loads, which Triton's interpreter lacks), plus NF4's 16 levels (fp32 [16], `nf4_lut`). Element (o, i) of W [N, K]
is levels[code] * scale with code = byte (o, i // 2) >> 4 * (i % 2) & 15, scale = scale (o, i // 64).

`dq_rows` gives W[rows, c0 : c0 + C], a tile whose columns are consecutive input features: it loads each code byte
once ([R, C/2], contiguous along a row) and both its nibbles, and one scale per row and group ([R, C/64], or [R, 1]
when the tile lies within one group), so the per-element work is the level lookup, one multiply and the rounding.
The lookup has two forms (`MODES`; `ANYSEEK_QUANT4_DQ=name` picks one, for measuring them on a GPU:
benchmarks/quant4_gemm.py):
  select  a branch-free select tree on the code's 4 bits (no memory; 15 selects and 4 bit tests per element);
  gather  `tl.gather` from the 16 levels held in registers (Triton puts them in shared memory: one ld.shared each).
`legacy` is the first kernel's element-wise form (three gathered loads per element: the byte, the scale, the level),
kept for the benchmark's before/after (`dq_tile`).

Why `gather` is the default: on an H200 (Triton 3.6, stop 47) it was the fastest form of every 16B GEMM that
benchmarks/quant4_gemm.py times, 4.7-12.6x the legacy form. Compiled for sm_90 on the CPU (Triton 3.9), the dense
forward at 128x128x64 with 8 warps: SASS instructions / registers legacy 1,568 / 170, select 944 / 147, gather
640 / 127. Two more forms were tried and dropped: the levels read from global memory, as 16 levels or as a table
of 256 level pairs indexed by the byte. Triton's pipeliner turned their lookups into cp.async copies through shared
memory (188-288 KB of it for the routed experts' GEMMs), and Triton 3.6 could not compile them for sm_90 ("Illegal
shared layout", which aborts the process). gather reads the levels from a 64-byte table in shared memory
(conflict-free: 16 words in 16 banks). docs/kernels.md has the routed experts' counts.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

from anyseek.kernels.reference.quant4 import nf4_levels

MODES = {"legacy": 0, "select": 3, "gather": 4}  # (1 and 2: the dropped global-memory forms, see above)
DEFAULT_MODE = "gather"


def dq_mode() -> int:
    """The lookup form the 4-bit kernels compile with (`MODES`), from ANYSEEK_QUANT4_DQ (default DEFAULT_MODE); an
    unknown name is an error naming the choices."""
    name = os.environ.get("ANYSEEK_QUANT4_DQ", DEFAULT_MODE)
    if name not in MODES:
        raise ValueError(f"ANYSEEK_QUANT4_DQ={name!r}: choose one of {', '.join(MODES)}")
    return MODES[name]


@functools.cache
def nf4_lut(device: torch.device) -> torch.Tensor:
    """NF4's levels on `device` (fp32 [16]), made once per device (a kernel argument at every launch)."""
    return nf4_levels(device)


@triton.jit
def dq_tile(q_ptr, s_ptr, lut_ptr, o, i, mask, row_bytes, scale_at, GROUP: tl.constexpr):
    """(legacy) W[o, i] in fp32 for broadcastable index tensors o (output feature) and i (input feature) of one weight
    (q_ptr / s_ptr: its first byte / int16; row_bytes: bytes per row; scale_at: the first scale's int16 index within a
    row, K / 4). Masked elements are 0."""
    byte = tl.load(q_ptr + o * row_bytes + i // 2, mask=mask, other=0).to(tl.int32)
    code = (byte >> ((i % 2) * 4)) & 15
    bits = tl.load(s_ptr + o * (row_bytes // 2) + scale_at + i // GROUP, mask=mask, other=0).to(tl.int32)
    scale = ((bits & 0xFFFF) << 16).to(tl.float32, bitcast=True)
    return tl.load(lut_ptr + code) * scale


@triton.jit
def _select_level(c):
    """NF4's level of codes c (int32, 0..15) by a select tree on their bits: the literals are `nf4_levels()` in fp32
    (tests/test_quant4.py checks them against it)."""
    b0 = (c & 1) != 0
    v0 = tl.where(b0, -0.6401997208595276, -1.0)
    v1 = tl.where(b0, -0.35520434379577637, -0.47544431686401367)
    v2 = tl.where(b0, -0.16525882482528687, -0.25491970777511597)
    v3 = tl.where(b0, 0.0, -0.0813470408320427)
    v4 = tl.where(b0, 0.14388413727283478, 0.07109404355287552)
    v5 = tl.where(b0, 0.3033111095428467, 0.2203693389892578)
    v6 = tl.where(b0, 0.5107654929161072, 0.3971860408782959)
    v7 = tl.where(b0, 1.0, 0.6671259999275208)
    b1 = (c & 2) != 0
    w0 = tl.where(b1, v1, v0)
    w1 = tl.where(b1, v3, v2)
    w2 = tl.where(b1, v5, v4)
    w3 = tl.where(b1, v7, v6)
    b2 = (c & 4) != 0
    x0 = tl.where(b2, w1, w0)
    x1 = tl.where(b2, w3, w2)
    return tl.where((c & 8) != 0, x1, x0)


@triton.jit
def _levels(lut_ptr, byte, MODE: tl.constexpr):
    """The levels of both nibbles of code bytes `byte` (int32 [R, C/2]) -> (low nibbles', high nibbles') fp32
    [R, C/2] each (input feature 2j lies in the low nibble of byte j, 2j + 1 in its high one)."""
    if MODE == 3:
        lo = _select_level(byte & 15)
        hi = _select_level(byte >> 4)
    else:  # gather (and the legacy form's whole-tile dequantization, `dequantize`)
        levels = tl.load(lut_ptr + tl.arange(0, 16))
        n: tl.constexpr = byte.shape[0] * byte.shape[1]
        lo = tl.reshape(tl.gather(levels, tl.reshape(byte & 15, (n,)), 0), byte.shape)
        hi = tl.reshape(tl.gather(levels, tl.reshape(byte >> 4, (n,)), 0), byte.shape)
    return lo, hi


@triton.jit
def _scaled(v, scale, G: tl.constexpr):
    """v [R, C/2] (one nibble's levels: features 2j or 2j + 1) times its group's scale (scale [R, G]: feature 2j of
    the tile is in group 2j // (C / G), i.e. column j in group j // (C / 2G))."""
    if G == 1:
        return v * scale
    R: tl.constexpr = v.shape[0]
    H: tl.constexpr = v.shape[1]
    return tl.reshape(tl.reshape(v, (R, G, H // G)) * scale[:, :, None], (R, H))


@triton.jit
def dq_rows(q_ptr, s_ptr, lut_ptr, rows, rmask, c0, n_in, row_bytes, scale_at,
            C: tl.constexpr, GROUP: tl.constexpr, MODE: tl.constexpr, MASK_C: tl.constexpr, DTYPE: tl.constexpr):  # fmt: skip
    """W[rows, c0 : c0 + C] in DTYPE (level * scale in fp32, rounded once), [R, C], R = len(rows): rows (int32 [R])
    of one weight (q_ptr / s_ptr: its first byte / int16; row_bytes: bytes per row; scale_at: the first scale's
    int16 index within a row, K / 4; n_in: K).
    c0 is a multiple of C, and C of GROUP or GROUP of C (powers of two). Rows outside rmask and, with MASK_C,
    columns past n_in are 0."""
    HALF: tl.constexpr = C // 2
    G: tl.constexpr = C // GROUP if C > GROUP else 1  # scale groups in the tile
    half = tl.multiple_of(c0 // 2, HALF) + tl.arange(0, HALF)
    groups = c0 // GROUP + tl.arange(0, G)
    bmask = rmask[:, None]
    smask = rmask[:, None]
    if MASK_C:
        bmask = bmask & (half < n_in // 2)[None, :]
        smask = smask & (groups < n_in // GROUP)[None, :]
    byte = tl.load(q_ptr + rows[:, None] * row_bytes + half[None, :], mask=bmask, other=0).to(tl.int32)
    bits = tl.load(s_ptr + (rows * (row_bytes // 2) + scale_at)[:, None] + groups[None, :], mask=smask, other=0)
    scale = ((bits.to(tl.int32) & 0xFFFF) << 16).to(tl.float32, bitcast=True)  # [R, G]
    lo, hi = _levels(lut_ptr, byte, MODE)
    # scaled and rounded to the GEMM's dtype before the halves are joined: the [R, C] tile is never held in fp32
    # (register pressure: the routed experts' GEMMs run at the register limit)
    return tl.interleave(_scaled(lo, scale, G).to(DTYPE), _scaled(hi, scale, G).to(DTYPE))


@triton.jit
def _dequantize_kernel(q_ptr, s_ptr, lut_ptr, out_ptr, n_rows, n_in, row_bytes, scale_at,
                       GROUP: tl.constexpr, MODE: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):  # fmt: skip
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    c0 = tl.program_id(1) * BLOCK_C
    rmask = rows < n_rows
    w = dq_rows(q_ptr, s_ptr, lut_ptr, rows, rmask, c0, n_in, row_bytes, scale_at, BLOCK_C, GROUP, MODE, True,
                out_ptr.dtype.element_ty)  # fmt: skip
    cols = c0 + tl.arange(0, BLOCK_C)
    out = out_ptr + rows.to(tl.int64)[:, None] * n_in + cols[None, :]
    tl.store(out, w, mask=rmask[:, None] & (cols < n_in)[None, :])


def dequantize(packed: torch.Tensor, dtype: torch.dtype = torch.bfloat16, mode: int | None = None) -> torch.Tensor:
    """`reference/quant4.py: dequantize4` in one Triton pass: packed uint8 [..., N, 17K/32] -> [..., N, K] in dtype
    (the same values: level * scale in fp32, rounded once). The dequantize-then-GEMM alternative of
    benchmarks/quant4_gemm.py."""
    from anyseek.kernels.reference.quant4 import GROUP, in_features

    K = in_features(packed)
    rows = packed.reshape(-1, packed.shape[-1]).contiguous()
    out = torch.empty(rows.shape[0], K, dtype=dtype, device=packed.device)
    br, bc = (32, 128) if packed.is_cuda else (16, 64)
    grid = (triton.cdiv(rows.shape[0], br), triton.cdiv(K, bc))
    _dequantize_kernel[grid](rows, rows.view(torch.int16), nf4_lut(packed.device), out, rows.shape[0], K,
                             rows.shape[1], K // 4, GROUP=GROUP, MODE=dq_mode() if mode is None else mode,
                             BLOCK_R=br, BLOCK_C=bc, num_warps=4)  # fmt: skip
    return out.reshape(*packed.shape[:-1], K)


__all__ = ["MODES", "dequantize", "dq_mode", "dq_rows", "dq_tile", "nf4_lut"]
