"""The Triton FP8 linear layer as PyTorch ops: the forward and the backward of `kernels.fp8_linear` as
torch.library custom ops (with fake implementations, so that torch.compile traces them without running them) over
`triton/fp8_quant.py` and `triton/fp8_gemm.py`, the autograd Function around them (its forward and backward are
`kernels/fp8.py`'s, which the PyTorch twin's Function shares) and `fp8_linear`, what the registry loads as the
triton backend. Importing this module imports Triton.

    forward   q_x, s_x = x in 1x128 tiles;  q_w, s_w, q_wt = W in 128x128 blocks (and W^T's values)
              y = gemm(q_x, s_x, q_w, s_w)                                  -> keeps q_x, s_x, q_wt, s_w
    backward  q_dy, s_dy, q_dyt, s_dyt = dy in 1x128 tiles, and dy^T along the tokens (one read)
              dx = gemm(q_dy, s_dy, q_wt, s_w^T)        dW = gemm(q_dyt, s_dyt, x^T re-tiled from q_x) in fp32

Shape legend: M rows, K input features, N output features, KB / MB / NB their counts of 128-blocks.
"""

from __future__ import annotations

import torch
import triton

from anyseek.kernels import fp8 as fp8_autograd
from anyseek.kernels.triton import fp8_gemm, fp8_quant

E4M3 = torch.float8_e4m3fn


@torch.library.custom_op("anyseek::fp8_linear_fwd", mutates_args=())
def _fwd_op(x_MK: torch.Tensor, w_NK: torch.Tensor, out_dtype: torch.dtype
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    q_x, s_x = fp8_quant.quantize_rows(x_MK)
    q_w, s_w, q_wt = fp8_quant.quantize_blocks(w_NK)
    return fp8_gemm.gemm(q_x, s_x, q_w, s_w, out_dtype), q_x, s_x, q_wt, s_w


@_fwd_op.register_fake
def _(x_MK, w_NK, out_dtype):
    (M, K), N = x_MK.shape, w_NK.shape[0]
    KB, NB = triton.cdiv(K, 128), triton.cdiv(N, 128)
    f32 = torch.float32
    return (x_MK.new_empty(M, N, dtype=out_dtype), x_MK.new_empty(M, K, dtype=E4M3), x_MK.new_empty(M, KB, dtype=f32),
            x_MK.new_empty(K, N, dtype=E4M3), x_MK.new_empty(NB, KB, dtype=f32))  # fmt: skip


@torch.library.custom_op("anyseek::fp8_linear_bwd", mutates_args=())
def _bwd_op(dy_MN: torch.Tensor, q_x: torch.Tensor, s_x: torch.Tensor, q_wt: torch.Tensor, s_w: torch.Tensor,
            dx_dtype: torch.dtype, want_dx: bool, want_dw: bool) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """-> (dx [M, K] in dx_dtype, dW [N, K] fp32); an empty tensor for a gradient not wanted."""
    K = q_x.shape[1]
    dx = q_x.new_empty(0, K, dtype=dx_dtype)
    dw = q_x.new_empty(0, K, dtype=torch.float32)
    if want_dx and want_dw:  # dy read once for both layouts
        q_dy, s_dy, q_dyt, s_dyt = fp8_quant.quantize_both(dy_MN)
    elif want_dx:
        q_dy, s_dy = fp8_quant.quantize_rows(dy_MN)
    elif want_dw:
        q_dyt, s_dyt = fp8_quant.quantize_rows_t(dy_MN)
    if want_dx:
        dx = fp8_gemm.gemm(q_dy, s_dy, q_wt, s_w.t(), dx_dtype)  # W^T's blocks: W's scales transposed
    if want_dw:
        q_xt, s_xt = fp8_quant.requantize_t(q_x, s_x)
        dw = fp8_gemm.gemm(q_dyt, s_dyt, q_xt, s_xt, torch.float32)
    return dx, dw


@_bwd_op.register_fake
def _(dy_MN, q_x, s_x, q_wt, s_w, dx_dtype, want_dx, want_dw):
    (M, K), N = q_x.shape, dy_MN.shape[1]
    return (q_x.new_empty(M if want_dx else 0, K, dtype=dx_dtype),
            q_x.new_empty(N if want_dw else 0, K, dtype=torch.float32))  # fmt: skip


def linear_forward(x_MK: torch.Tensor, w_NK: torch.Tensor, out_dtype: torch.dtype):
    """As `reference.fp8.linear_forward`: -> (y [M, N], saved: (q_x, s_x, q_wt, s_w))."""
    y, *saved = torch.ops.anyseek.fp8_linear_fwd(x_MK, w_NK, out_dtype)
    return y, tuple(saved)


def linear_backward(dy_MN: torch.Tensor, saved, dx_dtype: torch.dtype, want_dx: bool = True, want_dw: bool = True):
    """As `reference.fp8.linear_backward`: -> (dx or None, dW fp32 or None)."""
    dx, dw = torch.ops.anyseek.fp8_linear_bwd(dy_MN, *saved, dx_dtype, want_dx, want_dw)
    return (dx if want_dx else None), (dw if want_dw else None)


class _FP8LinearTriton(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_MK, w_NK, out_dtype):
        return fp8_autograd.forward(ctx, linear_forward, x_MK, w_NK, out_dtype)

    @staticmethod
    def backward(ctx, dy_MN):
        return fp8_autograd.backward(ctx, linear_backward, dy_MN)


def fp8_linear(x: torch.Tensor, w_NK: torch.Tensor) -> torch.Tensor:
    """The triton backend of `kernels.fp8_linear`: x [..., K], W [N, K] -> [..., N] (see `kernels.fp8_linear`)."""
    return fp8_autograd.run(x, w_NK, _FP8LinearTriton)
