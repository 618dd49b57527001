"""E4M3 quantization for FP8 training, DeepSeek-V3's tiles (twin: `kernels.reference.fp8`):

- `quantize_rows`: x [M, K] -> q [M, K], scales [M, KB]: 1x128 tiles (activations, output gradients), the scales
  rounded up to powers of two where asked (the routed experts' input, the rows expert parallelism sends: `pack_rows`);
- `quantize_rows_t`: x [M, K] -> x^T's q [K, M], scales [K, MB]: 1x128 tiles along M, written transposed so that
  Wgrad's GEMM reads both operands K-contiguous (Hopper's FP8 MMA wants K-major operands). The same kernel does
  Wgrad's re-tiling of the forward's FP8 x (`requantize_t`): it dequantizes with the 1x128 scales as it loads;
- `quantize_both`: both of the above from one read of x (the output gradient: Dgrad wants its rows, Wgrad its
  transposed tiles);
- `quantize_blocks`: w [N, K] -> q [N, K], q^T [K, N], scales [NB, KB]: 128x128 blocks, and the transposed copy
  Dgrad reads (the blocks are square: w^T's scales are w's, transposed).

scale = amax / 448 (1 for an all-zero tile) and q = x / scale, both divisions rounded to nearest (`div_rn`, as
PyTorch's; Triton's `/` is an approximate division on the GPU), so that the kernels and the twin give the same bits.
The rounding to E4M3 is done in fp32 here (`_round_e4m3`, round to nearest even, subnormals included) and the
conversion then only changes the format: Triton's interpreter converts fp32 to fp8 wrongly where the rounding
carries into the exponent (1.97 -> 1.0, triton 3.9), and the GPU's own conversion gives the same bits as this one.

Shape legend: M rows, K columns (the reduction dim of the GEMM that reads the result), MB / KB / NB 128-blocks.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

TILE = 128
E4M3_MAX = 448.0
BR = 32  # rows per program of quantize_rows: a [32, 128] tile, 4 warps
BC = 32  # columns per program of quantize_rows_t: a [128, 32] tile


@triton.jit
def _round_e4m3(y):
    """y (fp32, |y| <= 448) rounded to the nearest E4M3 value (ties to even), still fp32."""
    bits = y.to(tl.uint32, bitcast=True)
    keep = (bits + 0x7FFFF + ((bits >> 20) & 1)) & 0xFFF00000  # 3 stored mantissa bits, normal numbers
    normal = keep.to(tl.float32, bitcast=True)
    a = tl.abs(y) * 512.0  # subnormals (|y| < 2^-6): multiples of 2^-9, rounded to an integer count of them
    sub = ((a + 8388608.0) - 8388608.0) * 0.001953125
    sub = (sub.to(tl.uint32, bitcast=True) | (bits & 0x80000000)).to(tl.float32, bitcast=True)  # y's sign, -0 too
    return tl.where(tl.abs(y) < 0.015625, sub, normal)


@triton.jit
def _scale_of(amax):
    return tl.where(amax > 0, tl.math.div_rn(amax, tl.full(amax.shape, 448.0, tl.float32)), 1.0)


@triton.jit
def _pow2_up(s):
    """The least power of two >= s (s > 0 fp32): twin `reference.fp8.pow2_up`."""
    return ((s.to(tl.uint32, bitcast=True) + 0x7FFFFF) & 0xFF800000).to(tl.float32, bitcast=True)


@triton.jit
def _quantize_rows(x, POW2: tl.constexpr):
    """A fp32 tile -> (its E4M3 values, one scale per row: amax / 448, or with POW2 the power of two above it)."""
    s = _scale_of(tl.max(tl.abs(x), axis=1))
    if POW2:
        s = _pow2_up(s)
    return _round_e4m3(tl.math.div_rn(x, tl.broadcast_to(s[:, None], x.shape))), s


@triton.jit
def _quantize_cols(x):
    """A fp32 tile -> (its E4M3 values, one scale per column)."""
    s = _scale_of(tl.max(tl.abs(x), axis=0))
    return _round_e4m3(tl.math.div_rn(x, tl.broadcast_to(s[None, :], x.shape))), s


@triton.jit
def _tile(X, rows, cols, M, K, stride_x):
    """x[rows, cols] in fp32 (0 outside [M, K]) and its mask."""
    mask = (rows < M)[:, None] & (cols < K)[None, :]
    return tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32), mask


@triton.jit
def _store_rows(x, mask, Q, S, rows, cols, kb, M, stride_q, stride_s, POW2: tl.constexpr):
    """A tile's 1x128 rows quantized: q at [rows, cols], one scale per row at column kb of S."""
    q, s = _quantize_rows(x, POW2)
    tl.store(Q + rows[:, None] * stride_q + cols[None, :], q.to(Q.dtype.element_ty), mask=mask)
    tl.store(S + rows * stride_s + kb, s, mask=rows < M)


@triton.jit
def _store_cols_t(x, mask, QT, ST, rows, cols, mb, K, stride_qt, stride_st):
    """A tile's columns quantized along the rows, written transposed: q^T at [cols, rows], a scale per column at
    column mb of ST."""
    q, s = _quantize_cols(x)
    tl.store(QT + cols[None, :].to(tl.int64) * stride_qt + rows[:, None], q.to(QT.dtype.element_ty), mask=mask)
    tl.store(ST + cols * stride_st + mb, s, mask=cols < K)


@triton.jit
def _rows_kernel(X, Q, S, M, K, stride_x, stride_q, stride_s, BR: tl.constexpr, TILE: tl.constexpr,
                 POW2: tl.constexpr):  # fmt: skip
    rows = tl.program_id(0).to(tl.int64) * BR + tl.arange(0, BR)
    kb = tl.program_id(1)
    cols = kb * TILE + tl.arange(0, TILE)
    x, mask = _tile(X, rows, cols, M, K, stride_x)
    _store_rows(x, mask, Q, S, rows, cols, kb, M, stride_q, stride_s, POW2)


@triton.jit
def _cols_t_kernel(X, SX, QT, ST, M, K, stride_x, stride_sx, stride_qt, stride_st,
                   DEQUANT: tl.constexpr, BC: tl.constexpr, TILE: tl.constexpr):  # fmt: skip
    """A [128, BC] tile of x (rows mb*128.., columns) -> x^T's q at [columns, rows], scales [columns, mb]. DEQUANT:
    x is E4M3 with 1x128 scales SX [M, KB] (BC divides 128: one scale per row in the tile)."""
    mb = tl.program_id(0)
    rows = mb.to(tl.int64) * TILE + tl.arange(0, TILE)
    cols = tl.program_id(1) * BC + tl.arange(0, BC)
    x, mask = _tile(X, rows, cols, M, K, stride_x)
    if DEQUANT:
        sx = tl.load(SX + rows * stride_sx + (tl.program_id(1) * BC) // TILE, mask=rows < M, other=0.0)
        x = x * sx[:, None]
    _store_cols_t(x, mask, QT, ST, rows, cols, mb, K, stride_qt, stride_st)


@triton.jit
def _both_kernel(X, Q, S, QT, ST, M, K, stride_x, stride_q, stride_s, stride_qt, stride_st, TILE: tl.constexpr):
    """A [128, 128] tile of x -> its 1x128 rows (q, scales [M, KB]) and x^T's 1x128 tiles along M (q^T, scales
    [K, MB]) from one read of x (the output gradient, which Dgrad and Wgrad both quantize)."""
    mb, kb = tl.program_id(0), tl.program_id(1)
    rows = mb.to(tl.int64) * TILE + tl.arange(0, TILE)
    cols = kb * TILE + tl.arange(0, TILE)
    x, mask = _tile(X, rows, cols, M, K, stride_x)
    _store_rows(x, mask, Q, S, rows, cols, kb, M, stride_q, stride_s, False)
    _store_cols_t(x, mask, QT, ST, rows, cols, mb, K, stride_qt, stride_st)


@triton.jit
def _blocks_kernel(W, Q, QT, S, N, K, stride_w, stride_q, stride_qt, stride_s, TILE: tl.constexpr):
    nb, kb = tl.program_id(0), tl.program_id(1)
    rows = nb.to(tl.int64) * TILE + tl.arange(0, TILE)
    cols = kb * TILE + tl.arange(0, TILE)
    mask = (rows < N)[:, None] & (cols < K)[None, :]
    w = tl.load(W + rows[:, None] * stride_w + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    s = _scale_of(tl.max(tl.max(tl.abs(w), axis=1), axis=0))
    q = _round_e4m3(tl.math.div_rn(w, tl.full(w.shape, 1.0, tl.float32) * s)).to(Q.dtype.element_ty)
    tl.store(Q + rows[:, None] * stride_q + cols[None, :], q, mask=mask)
    tl.store(QT + cols[None, :].to(tl.int64) * stride_qt + rows[:, None], q, mask=mask)
    tl.store(S + nb * stride_s + kb, s)


def _check(x: torch.Tensor, what: str) -> None:
    if x.dim() != 2 or x.stride(-1) != 1:
        raise ValueError(f"{what}: a 2-D tensor with a contiguous last dim expected, got {tuple(x.shape)} "
                         f"(strides {x.stride()})")


def quantize_rows(x_MK: torch.Tensor, pow2: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """1x128 tiles: x [M, K] -> (q [M, K] E4M3, scales [M, KB] fp32); pow2: power-of-two scales (twin's)."""
    _check(x_MK, "quantize_rows")
    M, K = x_MK.shape
    q = torch.empty(M, K, dtype=torch.float8_e4m3fn, device=x_MK.device)
    s = torch.empty(M, triton.cdiv(K, TILE), dtype=torch.float32, device=x_MK.device)
    if M and K:
        _rows_kernel[(triton.cdiv(M, BR), s.shape[1])](x_MK, q, s, M, K, x_MK.stride(0), q.stride(0), s.stride(0),
                                                       BR=BR, TILE=TILE, POW2=pow2, num_warps=4)
    return q, s


def _cols_t(x_MK: torch.Tensor, s_MB: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    M, K = x_MK.shape
    qt = torch.empty(K, M, dtype=torch.float8_e4m3fn, device=x_MK.device)
    st = torch.empty(K, triton.cdiv(M, TILE), dtype=torch.float32, device=x_MK.device)
    if M and K:
        sx = s_MB if s_MB is not None else st  # (not read without DEQUANT)
        _cols_t_kernel[(st.shape[1], triton.cdiv(K, BC))](x_MK, sx, qt, st, M, K, x_MK.stride(0), sx.stride(0),
                                                          qt.stride(0), st.stride(0), DEQUANT=s_MB is not None,
                                                          BC=BC, TILE=TILE, num_warps=4)  # fmt: skip
    return qt, st


def quantize_rows_t(x_MK: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x^T in 1x128 tiles along M: x [M, K] -> (q [K, M] E4M3, scales [K, MB] fp32)."""
    _check(x_MK, "quantize_rows_t")
    return _cols_t(x_MK, None)


def requantize_t(q_MK: torch.Tensor, s_MB: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Wgrad's re-tiling: 1x128-tiled q [M, K], scales [M, KB] -> x^T's q [K, M], scales [K, MB]."""
    _check(q_MK, "requantize_t")
    if s_MB.shape != (q_MK.shape[0], triton.cdiv(q_MK.shape[1], TILE)):
        raise ValueError(f"requantize_t: scales {tuple(s_MB.shape)} do not fit q {tuple(q_MK.shape)} (1x128 tiles)")
    return _cols_t(q_MK, s_MB)


def quantize_both(x_MK: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """`quantize_rows` and `quantize_rows_t` of x from one read: -> (q [M, K], scales [M, KB], q^T [K, M],
    scales [K, MB])."""
    _check(x_MK, "quantize_both")
    M, K = x_MK.shape
    dev = x_MK.device
    q, qt = torch.empty(M, K, dtype=torch.float8_e4m3fn, device=dev), torch.empty(K, M, dtype=torch.float8_e4m3fn,
                                                                                 device=dev)  # fmt: skip
    s = torch.empty(M, triton.cdiv(K, TILE), dtype=torch.float32, device=dev)
    st = torch.empty(K, triton.cdiv(M, TILE), dtype=torch.float32, device=dev)
    if M and K:
        _both_kernel[(st.shape[1], s.shape[1])](x_MK, q, s, qt, st, M, K, x_MK.stride(0), q.stride(0), s.stride(0),
                                                qt.stride(0), st.stride(0), TILE=TILE, num_warps=8)  # fmt: skip
    return q, s, qt, st


def quantize_blocks(w_NK: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """128x128 blocks: w [N, K] -> (q [N, K] E4M3, scales [NB, KB] fp32, q^T [K, N] E4M3 contiguous)."""
    _check(w_NK, "quantize_blocks")
    N, K = w_NK.shape
    q = torch.empty(N, K, dtype=torch.float8_e4m3fn, device=w_NK.device)
    qt = torch.empty(K, N, dtype=torch.float8_e4m3fn, device=w_NK.device)
    s = torch.empty(triton.cdiv(N, TILE), triton.cdiv(K, TILE), dtype=torch.float32, device=w_NK.device)
    if N and K:
        _blocks_kernel[s.shape](w_NK, q, qt, s, N, K, w_NK.stride(0), q.stride(0), qt.stride(0), s.stride(0),
                                TILE=TILE, num_warps=8)
    return q, s, qt


def pack_rows(x_MK: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows as expert parallelism sends them (twin `reference.fp8.pack_rows`): x [M, K] -> (E4M3 codes as bytes
    [M, K] uint8, power-of-two 1x128 scales [M, KB] fp32)."""
    q, s = quantize_rows(x_MK.contiguous(), pow2=True)
    return q.view(torch.uint8), s


def unpack_rows(q_MK: torch.Tensor, s_MB: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`pack_rows`' bytes and scales -> the values in `dtype`, exactly (an E4M3 value times a power of two), in
    `dtype` throughout where it holds them exactly (bf16, fp32: no fp32 temporary for bf16 rows)."""
    M, K = q_MK.shape
    KB = s_MB.shape[1]
    work = dtype if dtype in (torch.bfloat16, torch.float32) else torch.float32
    pad = KB * TILE - K
    q = q_MK.view(torch.float8_e4m3fn).to(work)
    if pad:
        q = torch.nn.functional.pad(q, (0, pad))
    out = (q.view(M, KB, TILE) * s_MB.to(work)[:, :, None]).view(M, KB * TILE)
    return (out[:, :K] if pad else out).to(dtype)
