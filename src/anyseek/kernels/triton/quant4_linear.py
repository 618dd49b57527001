"""Triton GEMMs over a 4-bit frozen weight, dequantized tile by tile in the loop over K (`quant4_dq.py`): the
forward y = x dq(W)^T and the input gradient dx = g dq(W) of a linear layer (no weight gradient: the base is
frozen), and the triton backend of `kernels.low_rank_linear` for packed weights (`quant4_lowrank.py` adds LoRA's
rank-r term and the autograd around them). From 2,048 rows the default route dequantizes W first and multiplies in
torch (`_prepass`, ANYSEEK_QUANT4_DENSE); below, nothing the size of W in bf16 is formed.

Shape legend: M rows, K reduction length, N output columns; W [out, in] packed as [out, 17 in / 32] bytes.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from anyseek.kernels.quant4_lowrank import quant4_low_rank_linear
from anyseek.kernels.reference.quant4 import GROUP, in_features
from anyseek.kernels.triton.launch import launch
from anyseek.kernels.triton.quant4_dq import dequantize, dq_mode, dq_rows, dq_tile, nf4_lut

# (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages): on a GPU not tuned yet (the MoE's "swiglu" tile shape with
# BLOCK_K = one scale group); in the interpreter the smallest tiles tl.dot takes
_GPU, _INTERP = (128, 128, 64, 8, 3), (16, 16, 16, 1, 1)


@triton.jit
def _q4_gemm_kernel(a_ptr, q_ptr, s_ptr, lut_ptr, c_ptr, M, N, K, stride_am, stride_cm, row_bytes, scale_at,
                    Q_K_IN: tl.constexpr, GROUP: tl.constexpr, PREC: tl.constexpr, DQ: tl.constexpr,
                    EVEN_K: tl.constexpr, EVEN_N: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):  # fmt: skip
    """C [M, N] = A [M, K] @ Wk, Wk[k, n] = dq(W)[n, k] where Q_K_IN (the forward: K is W's input dim), else
    dq(W)[k, n] (the input gradient: K is W's output dim). DQ: the lookup form (`quant4_dq.MODES`; 0 the legacy
    element-wise dequantization)."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    rmask, cmask = rows < M, cols < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        kmask = ks < K
        a = tl.load(a_ptr + rows.to(tl.int64)[:, None] * stride_am + ks[None, :],
                    mask=rmask[:, None] & kmask[None, :], other=0.0)  # fmt: skip
        if DQ == 0:
            wmask = kmask[:, None] & cmask[None, :]
            if Q_K_IN:
                w = dq_tile(q_ptr, s_ptr, lut_ptr, cols[None, :], ks[:, None], wmask, row_bytes, scale_at, GROUP)
            else:
                w = dq_tile(q_ptr, s_ptr, lut_ptr, ks[:, None], cols[None, :], wmask, row_bytes, scale_at, GROUP)
        elif Q_K_IN:  # W's rows `cols`, its inputs k0.. : [BLOCK_N, BLOCK_K], transposed for the dot
            w = tl.trans(dq_rows(q_ptr, s_ptr, lut_ptr, cols, cmask, k0, K, row_bytes, scale_at,
                                 BLOCK_K, GROUP, DQ, not EVEN_K, a_ptr.dtype.element_ty))  # fmt: skip
        else:  # W's rows `ks` (its outputs), its inputs from program 1's first column: [BLOCK_K, BLOCK_N]
            w = dq_rows(q_ptr, s_ptr, lut_ptr, ks, kmask, tl.program_id(1) * BLOCK_N, N, row_bytes, scale_at,
                        BLOCK_N, GROUP, DQ, not EVEN_N, a_ptr.dtype.element_ty)  # fmt: skip
        acc = tl.dot(a, w.to(a_ptr.dtype.element_ty), acc, input_precision=PREC)
    c_ptrs = c_ptr + rows.to(tl.int64)[:, None] * stride_cm + cols[None, :]
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=rmask[:, None] & cmask[None, :])


def _launch(a: torch.Tensor, W: torch.Tensor, forward: bool, dq: int | None = None,
            tile: tuple | None = None) -> torch.Tensor:  # fmt: skip
    K_in = in_features(W)
    out_f = W.shape[0]
    M, K = a.shape
    N = out_f if forward else K_in
    assert K == (K_in if forward else out_f) and W.is_contiguous(), "quant4 GEMM: shapes or layout"
    a = a.contiguous()
    c = a.new_empty(M, N)
    if M == 0:
        return c
    bm, bn, bk, warps, stages = tile or (_GPU if a.is_cuda else _INTERP)
    grid = (triton.cdiv(M, bm), triton.cdiv(N, bn))
    cfg = {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "num_warps": warps, "num_stages": stages}
    launch(_q4_gemm_kernel, grid, cfg)(
        a, W, W.view(torch.int16), nf4_lut(a.device), c, M, N, K, a.stride(0), c.stride(0), W.shape[1],
        K_in // 4, Q_K_IN=forward, GROUP=GROUP, PREC="ieee" if a.dtype == torch.float32 else "tf32",
        DQ=dq_mode() if dq is None else dq, EVEN_K=K % bk == 0, EVEN_N=N % bn == 0)
    return c


PREPASS_ROWS = 2048  # the dense route's switch under ANYSEEK_QUANT4_DENSE=auto (see `_prepass`)


def _prepass(rows: int) -> bool:
    """Whether a dense GEMM of `rows` activation rows dequantizes W first (`quant4_dq.dequantize`, one Triton pass
    to the activations' dtype; a transient the size of W in bf16, 88 MiB for the 16B's largest, the dense MLP's
    gate|up) and calls torch's matmul, or dequantizes inside the GEMM. ANYSEEK_QUANT4_DENSE: `auto` (default): the
    pre-pass from PREPASS_ROWS rows; `fused`, `prepass`: always that route; anything else is an error naming the
    choices. Why: the fused GEMM dequantizes each tile of W once per BLOCK_M rows, the pre-pass once. On an H200
    (stop 47, benchmarks/quant4_gemm.py, 4,096 rows, 16B's dense shapes, forward and input gradient) the pre-pass +
    cuBLAS took 0.25-0.91x the fused kernel's time on all 12, and the 16B LoRA step 594 against 735 ms; at few rows
    the fused kernel reads a quarter of the bytes and launches once."""
    route = os.environ.get("ANYSEEK_QUANT4_DENSE", "auto")
    if route not in ("auto", "fused", "prepass"):
        raise ValueError(f"ANYSEEK_QUANT4_DENSE={route!r}: choose auto, fused or prepass")
    return route == "prepass" or (route == "auto" and rows >= PREPASS_ROWS)


def matmul_wt(x: torch.Tensor, W: torch.Tensor, dq: int | None = None, tile: tuple | None = None) -> torch.Tensor:
    """x [M, in] @ dq(W)^T -> [M, out] in x's dtype (fp32 sums). dq: the lookup form (`quant4_dq.MODES`, default
    `dq_mode()`); tile: (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages) instead of the default (benchmarks). Either
    given: always the fused kernel."""
    if dq is None and tile is None and _prepass(x.shape[0]):
        return x @ dequantize(W, x.dtype).t()
    return _launch(x, W, True, dq, tile)


def matmul_w(g: torch.Tensor, W: torch.Tensor, dq: int | None = None, tile: tuple | None = None) -> torch.Tensor:
    """g [M, out] @ dq(W) -> [M, in] in g's dtype (fp32 sums); dq, tile as for `matmul_wt`."""
    if dq is None and tile is None and _prepass(g.shape[0]):
        return g @ dequantize(W, g.dtype)
    return _launch(g, W, False, dq, tile)


def low_rank_linear(x: torch.Tensor, W: torch.Tensor, A: torch.Tensor, B, xd: torch.Tensor | None = None,
                    scale: float = 1.0) -> torch.Tensor:  # fmt: skip
    """The triton backend of `kernels.low_rank_linear` for a packed W (shapes there)."""
    return quant4_low_rank_linear(x, W, A, B, xd, scale, matmul_wt, matmul_w)


__all__ = ["low_rank_linear", "matmul_w", "matmul_wt"]
