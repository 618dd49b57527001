"""`kernels.fp8_linear`'s and `kernels.fp8_routed_experts`' autograd Functions, one body for both backends: y = x W^T with DeepSeek-V3's FP8 recipe
(`kernels/reference/fp8.py` describes it). A backend is a pair of functions, `linear_forward(x, w, out_dtype) ->
(y, saved)` and `linear_backward(dy, saved, dx_dtype, want_dx, want_dw) -> (dx, dW in fp32)`, `saved` a tuple of
tensors only the backend reads: the PyTorch twin's (`reference/fp8.py`, any device) or the Triton kernels' as
custom ops (`ops/fp8.py`, loaded only when chosen, with its own Function over the helpers here; torch.compile
traces them).

Forward: x in 1x128 tiles, W in 128x128 blocks (from the weight as it is at this step: no delayed scaling), one
promoted FP8 GEMM. What backward keeps: x's E4M3 values and scales (1 byte an element instead of bf16's 2) and W's
E4M3 values (W^T's, K-contiguous, for the Triton Dgrad) with its block scales. Backward: Dgrad dx = dy W (dy in
1x128 tiles along the output features), Wgrad dW = dy^T x in fp32 (dy and x re-tiled 1x128 along the tokens, x from
its FP8 copy), handed back in the weight's dtype.

The routed experts' Function (`kernels.fp8_routed_experts`) is built the same way: a backend's
`experts_forward` / `experts_backward` (`reference/fp8.py`, `ops/fp8.py`).

Shape legend: M rows (all leading dims of x), K input features, N output features; T tokens, K experts per token.
"""

from __future__ import annotations

import contextlib

import torch

from anyseek.kernels.reference import fp8 as ref


def forward(ctx, backend_forward, x_MK, w_NK, out_dtype):
    """An FP8 linear Function's forward through a backend's `linear_forward`."""
    y, saved = backend_forward(x_MK, w_NK, out_dtype)
    ctx.save_for_backward(*saved)
    ctx.x_dtype, ctx.w_dtype = x_MK.dtype, w_NK.dtype
    return y


def backward(ctx, backend_backward, dy_MN):
    """Its backward through the backend's `linear_backward`: (dx, dW in the weight's dtype, None)."""
    want_dx, want_dw = ctx.needs_input_grad[:2]
    dx, dw = backend_backward(dy_MN.contiguous(), ctx.saved_tensors, ctx.x_dtype, want_dx, want_dw)
    return dx, (dw.to(ctx.w_dtype) if dw is not None else None), None


class _FP8Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_MK, w_NK, out_dtype):
        return forward(ctx, ref.linear_forward, x_MK, w_NK, out_dtype)

    @staticmethod
    def backward(ctx, dy_MN):
        return backward(ctx, ref.linear_backward, dy_MN)


def run(x: torch.Tensor, w_NK: torch.Tensor, fn) -> torch.Tensor:
    """x [..., K] @ W^T through the Function `fn` -> [..., N] in autocast's dtype where autocast is on (as
    F.linear), else x's."""
    kind = x.device.type
    autocast = kind in ("cuda", "cpu") and torch.is_autocast_enabled(kind)
    out_dtype = torch.get_autocast_dtype(kind) if autocast else x.dtype
    x_MK = x.reshape(-1, x.shape[-1])
    if x_MK.stride(-1) != 1:
        x_MK = x_MK.contiguous()
    w = w_NK if w_NK.stride(-1) == 1 else w_NK.contiguous()
    with torch.autocast(kind, enabled=False) if autocast else contextlib.nullcontext():
        y = fn.apply(x_MK, w, out_dtype)
    return y.view(*x.shape[:-1], w_NK.shape[0])


def fp8_linear_reference(x: torch.Tensor, w_NK: torch.Tensor) -> torch.Tensor:
    """The pure-PyTorch backend: the twin's quantization and K-block loop (`kernels.reference.fp8`)."""
    return run(x, w_NK, _FP8Linear)


# ------------------------------------------------------------------------------------------------ the routed experts


def experts_fwd(ctx, backend_forward, x_TD, topk_ids_TK, topk_weights_TK, gate_up_EFD, down_EDI):
    """An FP8 experts Function's forward through a backend's `experts_forward`."""
    y, saved = backend_forward(x_TD, topk_ids_TK, topk_weights_TK, gate_up_EFD, down_EDI)
    ctx.save_for_backward(*saved)
    ctx.dtypes = (topk_weights_TK.dtype, gate_up_EFD.dtype, down_EDI.dtype)
    return y


def experts_bwd(ctx, backend_backward, dy_TD):
    """Its backward: (dx, None, d topk_weights, d gate_up, d down) in their inputs' dtypes."""
    dx, dw, d_gu, d_dn = backend_backward(dy_TD.contiguous(), ctx.saved_tensors)
    w_dt, gu_dt, dn_dt = ctx.dtypes
    return dx, None, dw.to(w_dt), d_gu.to(gu_dt), d_dn.to(dn_dt)


class _FP8Experts(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_TD, topk_ids_TK, topk_weights_TK, gate_up_EFD, down_EDI):
        return experts_fwd(ctx, ref.experts_forward, x_TD, topk_ids_TK, topk_weights_TK, gate_up_EFD, down_EDI)

    @staticmethod
    def backward(ctx, dy_TD):
        return experts_bwd(ctx, ref.experts_backward, dy_TD)


def run_experts(x_TD, topk_ids_TK, topk_weights_TK, gate_up_EFD, down_EDI, add_TD, fn) -> torch.Tensor:
    """The routed experts through the Function `fn` in autocast's dtype where autocast is on, else x's; the weights
    are quantized from whatever dtype they have (fp32 masters, the bf16 working copy); add_TD added after."""
    kind = x_TD.device.type
    autocast = kind in ("cuda", "cpu") and torch.is_autocast_enabled(kind)
    dtype = torch.get_autocast_dtype(kind) if autocast else x_TD.dtype
    with torch.autocast(kind, enabled=False) if autocast else contextlib.nullcontext():
        y = fn.apply(x_TD.to(dtype).contiguous(), topk_ids_TK.contiguous(), topk_weights_TK.contiguous(),
                     gate_up_EFD.contiguous(), down_EDI.contiguous())  # fmt: skip
    y = y.to(x_TD.dtype)
    return y if add_TD is None else y + add_TD


def fp8_routed_experts_reference(x_TD, topk_ids_TK, topk_weights_TK, gate_up_EFD, down_EDI, add_TD=None):
    """The pure-PyTorch backend of `kernels.fp8_routed_experts` (`reference.fp8.experts_forward`, a loop over
    experts)."""
    return run_experts(x_TD, topk_ids_TK, topk_weights_TK, gate_up_EFD, down_EDI, add_TD, _FP8Experts)
