"""The Triton FP8 linear layer as PyTorch ops, and the Triton FP8 routed experts: the forward and the backward of `kernels.fp8_linear` as
torch.library custom ops (with fake implementations, so that torch.compile traces them without running them) over
`triton/fp8_quant.py` and `triton/fp8_gemm.py`, the autograd Function around them (its forward and backward are
`kernels/fp8.py`'s, which the PyTorch twin's Function shares) and `fp8_linear`, what the registry loads as the
triton backend. Importing this module imports Triton.

    forward   q_x, s_x = x in 1x128 tiles;  q_w, s_w, q_wt = W in 128x128 blocks (and W^T's values)
              y = gemm(q_x, s_x, q_w, s_w)                                  -> keeps q_x, s_x, q_wt, s_w
    backward  q_dy, s_dy, q_dyt, s_dyt = dy in 1x128 tiles, and dy^T along the tokens (one read)
              dx = gemm(q_dy, s_dy, q_wt, s_w^T)        dW = gemm(q_dyt, s_dyt, x^T re-tiled from q_x) in fp32

The routed experts (`fp8_routed_experts`; an autograd Function over the launchers, no custom ops yet): the routing
plan (`moe_plan.build_plan`, 128-row tiles), x per 1x128 tile before the gather, each expert's weights in 128x128
blocks, the grouped GEMMs of `triton/fp8_grouped.py` (gate|up gathering token rows, down scattering to token order;
backward: d_act gathering dy's rows, dx scattering, Wgrad over each expert's plan tiles), the weighted SwiGLU in
fp32 between them, quantized as it is made (`swiglu_quant`), and its gradient (`dswiglu`) (kernels of their own:
not fused into the GEMMs' epilogues yet).

Shape legend: M rows, K input features, N output features, KB / MB / NB their counts of 128-blocks; for the experts
T tokens, K experts per token, E experts, D hidden, I expert width, F = 2I.
"""

from __future__ import annotations

import torch
import triton

from anyseek.kernels import fp8 as fp8_autograd
from anyseek.kernels.triton import fp8_gemm, fp8_grouped, fp8_quant
from anyseek.kernels.triton.moe import sum_k
from anyseek.kernels.triton.moe_plan import build_plan

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


# ------------------------------------------------------------------------------------------------ the routed experts

BLOCK_M = 128  # the routing plan's row tile: the recipe's 128 rows along the tokens for Wgrad, and the GEMMs' BM


def _expert_blocks(w_ENK: torch.Tensor):
    """Each expert's weight in 128x128 blocks -> (q [E, N, K], scales [E, NB, KB], q^T [E, K, N] (K-contiguous view
    for the transposed GEMMs), its scales [E, KB, NB]). With N a multiple of 128 one launch over the stacked rows
    (no block crosses two experts); else one per expert."""
    E, N, K = w_ENK.shape
    if N % 128 == 0:
        q, s, qt = fp8_quant.quantize_blocks(w_ENK.reshape(E * N, K))
        s = s.view(E, N // 128, -1)
        return q.view(E, N, K), s, qt.as_strided((E, K, N), (N, E * N, 1)), s.transpose(1, 2).contiguous()
    parts = [fp8_quant.quantize_blocks(w) for w in w_ENK]
    s = torch.stack([p[1] for p in parts])
    return (torch.stack([p[0] for p in parts]), s, torch.stack([p[2] for p in parts]),
            s.transpose(1, 2).contiguous())  # fmt: skip


def experts_forward(x_TD, topk_ids_TK, topk_weights_TK, gate_up_EFD, down_EDI):
    """As `reference.fp8.experts_forward`, on the Triton kernels: -> (y [T, D], saved)."""
    T, K = topk_ids_TK.shape
    E = gate_up_EFD.shape[0]
    plan = build_plan(topk_ids_TK, E, BLOCK_M)
    q_x, s_x = fp8_quant.quantize_rows(x_TD, pow2=True)  # power-of-two scales: as expert parallelism sends x
    q_gu, s_gu, q_gut, s_gut = _expert_blocks(gate_up_EFD)
    q_dn, s_dn, q_dnt, s_dnt = _expert_blocks(down_EDI)
    h = fp8_grouped.grouped_gemm(q_x, s_x, q_gu, s_gu, plan, BLOCK_M, x_TD.dtype, gather=True)
    w_M = topk_weights_TK.reshape(-1)[plan[0].long()]
    q_act, s_act = fp8_grouped.swiglu_quant(h, w_M)
    y_slot = fp8_grouped.grouped_gemm(q_act, s_act, q_dn, s_dn, plan, BLOCK_M, x_TD.dtype, scatter=True)
    saved = (q_x, s_x, h, q_act, s_act, q_gut, s_gut, q_dnt, s_dnt, topk_ids_TK, topk_weights_TK, *plan)
    return sum_k(y_slot, T, x_TD.dtype), saved  # (a token's K rows summed in fp32 and rounded once, one kernel)


def experts_backward(dy_TD: torch.Tensor, saved):
    """As `reference.fp8.experts_backward`: -> (dx, d topk_weights fp32, d gate_up fp32, d down fp32)."""
    q_x, s_x, h, q_act, s_act, q_gut, s_gut, q_dnt, s_dnt, topk_ids_TK, topk_weights_TK, *plan = saved
    T, K = topk_ids_TK.shape
    E = q_gut.shape[0]
    slot = plan[0].long()
    q_dy, s_dy = fp8_quant.quantize_rows(dy_TD, pow2=True)  # as expert parallelism sends dy to the experts
    d_act = fp8_grouped.grouped_gemm(q_dy, s_dy, q_dnt, s_dnt, plan, BLOCK_M, torch.float32, gather=True)
    dh, dw_M = fp8_grouped.dswiglu(h, topk_weights_TK.reshape(-1)[slot], d_act, dy_TD.dtype)
    q_dh, s_dh = fp8_quant.quantize_rows(dh)
    dx_slot = fp8_grouped.grouped_gemm(q_dh, s_dh, q_gut, s_gut, plan, BLOCK_M, dy_TD.dtype, scatter=True)
    dw = torch.zeros(T * K, dtype=torch.float32, device=dy_TD.device)
    valid = topk_ids_TK.reshape(-1)[slot] < E  # rows of slots no expert takes: in no tile, their values unset
    dw[slot] = torch.where(valid, dw_M, 0.0)
    d_dn = fp8_grouped.grouped_wgrad(*fp8_grouped.plan_rows_t(q_dy, plan, BLOCK_M, gather=True, s_RB=s_dy),
                                     *fp8_grouped.plan_rows_t(q_act, plan, BLOCK_M, s_RB=s_act), plan, E, BLOCK_M)
    d_gu = fp8_grouped.grouped_wgrad(*fp8_grouped.plan_rows_t(dh, plan, BLOCK_M),
                                     *fp8_grouped.plan_rows_t(q_x, plan, BLOCK_M, gather=True, s_RB=s_x), plan, E,
                                     BLOCK_M)  # fmt: skip
    return sum_k(dx_slot, T, dy_TD.dtype), dw.view(T, K), d_gu, d_dn


class _FP8ExpertsTriton(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_TD, topk_ids_TK, topk_weights_TK, gate_up_EFD, down_EDI):
        return fp8_autograd.experts_fwd(ctx, experts_forward, x_TD, topk_ids_TK, topk_weights_TK, gate_up_EFD,
                                        down_EDI)  # fmt: skip

    @staticmethod
    def backward(ctx, dy_TD):
        return fp8_autograd.experts_bwd(ctx, experts_backward, dy_TD)


@torch.compiler.disable  # (launches its kernels itself, no custom ops yet: under torch.compile a graph break)
def fp8_routed_experts(x_TD, topk_ids_TK, topk_weights_TK, gate_up_EFD, down_EDI, add_TD=None):
    """The triton backend of `kernels.fp8_routed_experts`."""
    return fp8_autograd.run_experts(x_TD, topk_ids_TK, topk_weights_TK, gate_up_EFD, down_EDI, add_TD,
                                    _FP8ExpertsTriton)  # fmt: skip
