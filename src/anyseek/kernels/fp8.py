"""`kernels.fp8_linear`'s autograd Function, one for both backends: y = x W^T with DeepSeek-V3's FP8 recipe
(`kernels/reference/fp8.py` describes it). A backend is a module of six functions with one contract:
`quantize_rows`, `quantize_rows_t`, `quantize_both`, `requantize_t`, `quantize_weight` and `gemm` (`reference.fp8`, the twin that
runs anywhere; `triton.fp8_quant` + `triton.fp8_gemm`, loaded only when chosen).

Forward: x in 1x128 tiles, W in 128x128 blocks (from the weight as it is at this step: no delayed scaling), one
promoted FP8 GEMM. What backward keeps: x's E4M3 values and scales (1 byte an element instead of bf16's 2) and
W^T's E4M3 values (Dgrad's operand, K-contiguous) with W's block scales. Backward: Dgrad dx = dy W (dy in 1x128
tiles along the output features), Wgrad dW = dy^T x in fp32 (dy and x re-tiled 1x128 along the tokens, x from its
FP8 copy), handed back in the weight's dtype; dy is quantized for both from one read (`quantize_both`).

Shape legend: M rows (all leading dims of x), K input features, N output features.
"""

from __future__ import annotations

import contextlib
import functools
import types

import torch


class _FP8Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_MK, w_NK, impl, out_dtype):
        q_x, s_x = impl.quantize_rows(x_MK)
        q_w, s_w, q_wt = impl.quantize_weight(w_NK)
        ctx.save_for_backward(q_x, s_x, q_wt, s_w)
        ctx.impl, ctx.x_dtype, ctx.w_dtype = impl, x_MK.dtype, w_NK.dtype
        return impl.gemm(q_x, s_x, q_w, s_w, out_dtype)

    @staticmethod
    def backward(ctx, dy_MN):
        q_x, s_x, q_wt, s_w = ctx.saved_tensors
        impl, dy_MN = ctx.impl, dy_MN.contiguous()
        want_dx, want_dw = ctx.needs_input_grad[:2]
        dx = dw = None
        if want_dx and want_dw:  # dy read once for both layouts
            q_dy, s_dy, q_dyt, s_dyt = impl.quantize_both(dy_MN)
        elif want_dx:
            q_dy, s_dy = impl.quantize_rows(dy_MN)
        elif want_dw:
            q_dyt, s_dyt = impl.quantize_rows_t(dy_MN)
        if want_dx:
            dx = impl.gemm(q_dy, s_dy, q_wt, s_w.t(), ctx.x_dtype)  # W^T's blocks: W's scales transposed
        if want_dw:
            q_xt, s_xt = impl.requantize_t(q_x, s_x)
            dw = impl.gemm(q_dyt, s_dyt, q_xt, s_xt, torch.float32).to(ctx.w_dtype)
        return dx, dw, None, None


def _run(x: torch.Tensor, w_NK: torch.Tensor, impl) -> torch.Tensor:
    """x [..., K] @ W^T through `impl` -> [..., N] in autocast's dtype where autocast is on (as F.linear), else x's."""
    kind = x.device.type
    autocast = kind in ("cuda", "cpu") and torch.is_autocast_enabled(kind)
    out_dtype = torch.get_autocast_dtype(kind) if autocast else x.dtype
    x_MK = x.reshape(-1, x.shape[-1])
    if x_MK.stride(-1) != 1:
        x_MK = x_MK.contiguous()
    w = w_NK if w_NK.stride(-1) == 1 else w_NK.contiguous()
    with torch.autocast(kind, enabled=False) if autocast else contextlib.nullcontext():
        y = _FP8Linear.apply(x_MK, w, impl, out_dtype)
    return y.view(*x.shape[:-1], w_NK.shape[0])


def fp8_linear_reference(x: torch.Tensor, w_NK: torch.Tensor) -> torch.Tensor:
    """The pure-PyTorch backend: the twin's quantization and K-block loop (`kernels.reference.fp8`)."""
    from anyseek.kernels.reference import fp8

    return _run(x, w_NK, fp8)


def fp8_linear_triton(x: torch.Tensor, w_NK: torch.Tensor) -> torch.Tensor:
    """The Triton backend: `triton/fp8_quant.py` and `triton/fp8_gemm.py`."""
    return _run(x, w_NK, _triton_impl())


@functools.cache
def _triton_impl():
    from anyseek.kernels.triton import fp8_gemm, fp8_quant

    return types.SimpleNamespace(quantize_rows=fp8_quant.quantize_rows, quantize_rows_t=fp8_quant.quantize_rows_t,
                                 quantize_both=fp8_quant.quantize_both, requantize_t=fp8_quant.requantize_t,
                                 quantize_weight=fp8_quant.quantize_blocks, gemm=fp8_gemm.gemm)  # fmt: skip
