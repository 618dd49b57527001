"""The Triton routed experts as PyTorch ops: torch.library custom ops (with fake implementations, so that
torch.compile traces them without running them) for the routing plan (`triton/moe_plan.py`) and the experts'
forward and backward (`triton/moe.py`), wrapped in autograd Functions for the plain experts and for the LoRA ones
(`triton/moe_lora.py`); `routed_experts` and `lora_routed_experts` are what the registry loads as the triton
backend. Importing this module imports Triton.

Shape legend: T tokens, K experts per token, M = T*K routed rows, E experts, D hidden, I expert width, F = 2I.
"""

from __future__ import annotations

import torch
import triton

from anyseek import kernels
from anyseek.kernels.reference.moe import effective_weights
from anyseek.kernels.triton.moe import block_m, experts_bwd, experts_fwd, narrow_tiles
from anyseek.kernels.triton.moe_lora import experts_bwd_lora, experts_fwd_lora
from anyseek.kernels.triton.moe_plan import build_plan


@torch.library.custom_op("anyseek::moe_plan", mutates_args=())
def _plan_op(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> list[torch.Tensor]:
    return list(build_plan(topk_ids, num_experts, block_m))


@_plan_op.register_fake
def _(topk_ids, num_experts, block_m):
    M = topk_ids.numel()
    n_ub = triton.cdiv(M, block_m) + num_experts
    sizes = (M, M, num_experts + 1, n_ub, n_ub)
    return [topk_ids.new_empty(n, dtype=torch.int32) for n in sizes]


@torch.library.custom_op("anyseek::moe_experts_fwd", mutates_args=())
def _fwd_op(
    x: torch.Tensor, w: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, slot: torch.Tensor,
    tok: torch.Tensor, offs: torch.Tensor, tile_expert: torch.Tensor, tile_row: torch.Tensor, save: bool,
    add: torch.Tensor | None = None, narrow: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    return experts_fwd(x, w, gate_up, down, (slot, tok, offs, tile_expert, tile_row), save, add_TD=add,
                       narrow=narrow)  # fmt: skip


@_fwd_op.register_fake
def _(x, w, gate_up, down, slot, tok, offs, tile_expert, tile_row, save, add=None, narrow=False):
    M, F = slot.shape[0], gate_up.shape[1]
    return x.new_empty(x.shape), x.new_empty(M if save else 0, F), x.new_empty(M, F // 2)


@torch.library.custom_op("anyseek::moe_experts_bwd", mutates_args=())
def _bwd_op(
    dy: torch.Tensor, x: torch.Tensor, w: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, h: torch.Tensor,
    act: torch.Tensor, slot: torch.Tensor, tok: torch.Tensor, offs: torch.Tensor, tile_expert: torch.Tensor,
    tile_row: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    return experts_bwd(dy, x, w, gate_up, down, h, act, (slot, tok, offs, tile_expert, tile_row))


@_bwd_op.register_fake
def _(dy, x, w, gate_up, down, h, act, slot, tok, offs, tile_expert, tile_row):
    return x.new_empty(x.shape), w.new_empty(w.shape, dtype=torch.float32), gate_up.new_empty(gate_up.shape), \
        down.new_empty(down.shape)  # fmt: skip


@torch.library.custom_op("anyseek::moe_experts_bwd_into", mutates_args=("dgu", "ddn"))
def _bwd_into_op(
    dy: torch.Tensor, x: torch.Tensor, w: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, h: torch.Tensor,
    act: torch.Tensor, slot: torch.Tensor, tok: torch.Tensor, offs: torch.Tensor, tile_expert: torch.Tensor,
    tile_row: torch.Tensor, dgu: torch.Tensor, ddn: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """As moe_experts_bwd, the weight gradients written into dgu and ddn (the trainer's flat gradient buffer)."""
    dx, dw, _, _ = experts_bwd(dy, x, w, gate_up, down, h, act, (slot, tok, offs, tile_expert, tile_row), dgu, ddn)
    return dx, dw


@_bwd_into_op.register_fake
def _(dy, x, w, gate_up, down, h, act, slot, tok, offs, tile_expert, tile_row, dgu, ddn):
    return x.new_empty(x.shape), w.new_empty(w.shape, dtype=torch.float32)


class _RoutedExperts(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_TD, topk_ids_TK, topk_weights_TK, gate_up_EFD, down_EDI, params, add_TD=None, grad=True):
        """grad: whether grad mode was on at the call (inside `forward` it is off; needs_input_grad is not)."""
        ctx.params = params  # the weights as parameters, for their gradient destinations (or None)
        save = grad and any(ctx.needs_input_grad[:5])
        narrow = narrow_tiles(topk_ids_TK.numel(), save)  # decoding: narrow row tiles (their own plan)
        plan = torch.ops.anyseek.moe_plan(topk_ids_TK, gate_up_EFD.shape[0], block_m(x_TD.device, narrow))
        w_M = topk_weights_TK.reshape(-1)
        y_TD, h_MF, act_MI = torch.ops.anyseek.moe_experts_fwd(x_TD, w_M, gate_up_EFD, down_EDI, *plan, save, add_TD,
                                                               narrow)  # fmt: skip
        ctx.save_for_backward(x_TD, w_M, gate_up_EFD, down_EDI, h_MF, act_MI, *plan)
        ctx.w_shape, ctx.w_dtype = topk_weights_TK.shape, topk_weights_TK.dtype
        return y_TD

    @staticmethod
    def backward(ctx, dy_TD):
        x_TD, w_M, gate_up_EFD, down_EDI, h_MF, act_MI, *plan = ctx.saved_tensors
        # ctx.params are the very tensors computed with: a destination (shaped and typed like them) takes the gradient
        dest = [kernels.grad_destination(p) for p in ctx.params] if ctx.params is not None else [None]
        if all(d is not None for d in dest):  # straight into the trainer's gradient buffer
            dgu, ddn = dest
            dx, dw_M = torch.ops.anyseek.moe_experts_bwd_into(
                dy_TD.contiguous(), x_TD, w_M, gate_up_EFD, down_EDI, h_MF, act_MI, *plan, dgu, ddn
            )
        else:
            dx, dw_M, dgu, ddn = torch.ops.anyseek.moe_experts_bwd(
                dy_TD.contiguous(), x_TD, w_M, gate_up_EFD, down_EDI, h_MF, act_MI, *plan
            )
        d_add = dy_TD if ctx.needs_input_grad[6] else None  # the addend's gradient is dy itself
        return dx, None, dw_M.view(ctx.w_shape).to(ctx.w_dtype), dgu, ddn, None, d_add, None


def _compute_dtype(x_TD: torch.Tensor) -> torch.dtype:
    """The dtype the experts compute in: autocast's where it is on (as it would cast a matmul's inputs), else x's."""
    kind = x_TD.device.type
    return torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else x_TD.dtype


class _LoRARoutedExperts(torch.autograd.Function):
    """Routed experts with frozen base weights and per-expert LoRA adapters (`experts_fwd_lora`): saved for backward
    are x, h and two [M, r] products (not the [M, I] SwiGLU output, recomputed from h); no effective weights.

    The B adapters come in unscaled, in their own dtype: the kernels read scale * B in the compute dtype (`_scaled`,
    [E, F, r]: formed in the forward and again in the backward), and B's gradient is scale times that of the scaled
    B. `params`: the four adapters as the trainer holds them, where the kernels may write their gradients into the
    trainer's buffer (`kernels.grad_destinations`: back to back, the compute dtype); then no gradient tensor of the
    adapters' size exists beside that buffer (the 16B LoRA: 0.41 GiB at the end of the backward)."""

    @staticmethod
    def forward(ctx, x_TD, topk_ids_TK, topk_weights_TK, W_gu, W_dn, A_gu, B_gu, A_dn, B_dn, add_TD, scale, dtype,
                params):  # fmt: skip
        plan = torch.ops.anyseek.moe_plan(topk_ids_TK, W_gu.shape[0], block_m(x_TD.device))
        w_M = topk_weights_TK.reshape(-1)
        adapters = (A_gu, _scaled(B_gu, scale, dtype), A_dn, _scaled(B_dn, scale, dtype))
        y_TD, h_MF, _, u_gu, u_dn = experts_fwd_lora(x_TD, w_M, W_gu, W_dn, adapters, plan, True, add_TD)
        ctx.save_for_backward(x_TD, w_M, W_gu, W_dn, A_gu, B_gu, A_dn, B_dn, h_MF, u_gu, u_dn, *plan)
        ctx.w_shape, ctx.w_dtype = topk_weights_TK.shape, topk_weights_TK.dtype
        ctx.scale, ctx.dtype, ctx.params = scale, dtype, params
        return y_TD

    @staticmethod
    def backward(ctx, dy_TD):
        x_TD, w_M, W_gu, W_dn, A_gu, B_gu, A_dn, B_dn, h_MF, u_gu, u_dn, *plan = ctx.saved_tensors
        scale, dtype = ctx.scale, ctx.dtype
        adapters = (A_gu, _scaled(B_gu, scale, dtype), A_dn, _scaled(B_dn, scale, dtype))
        out = kernels.grad_destinations(ctx.params) if ctx.params is not None else None
        dx, dw_M, dA_gu, dBs_gu, dA_dn, dBs_dn = experts_bwd_lora(dy_TD.contiguous(), x_TD, w_M, W_gu, W_dn, h_MF,
                                                                  u_gu, u_dn, plan, adapters, out)  # fmt: skip
        dB_gu, dB_dn = _unscaled(dBs_gu, B_gu, scale), _unscaled(dBs_dn, B_dn, scale)
        d_add = dy_TD if ctx.needs_input_grad[9] else None  # the addend's gradient is dy itself
        return (dx, None, dw_M.view(ctx.w_shape).to(ctx.w_dtype), None, None, dA_gu, dB_gu, dA_dn, dB_dn, d_add,
                None, None, None)  # fmt: skip


def _scaled(B: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """scale * B in B's dtype, then in the compute dtype (as LoRA's seam defines the product)."""
    return (B * scale).to(dtype).contiguous()


def _unscaled(g: torch.Tensor, B: torch.Tensor, scale: float) -> torch.Tensor:
    """B's gradient from that of the scaled B (`_scaled`'s backward: the cast back to B's dtype, then times
    scale); in place where the dtypes agree (g may be the trainer's buffer)."""
    return g.mul_(scale) if g.dtype == B.dtype else g.to(B.dtype) * scale


def _lora_apply(x_TD, topk_ids_TK, topk_weights_TK, W_gu, W_dn, A_gu, B_gu, A_dn, B_dn, scale, add_TD,
                out_dtype) -> torch.Tensor:  # fmt: skip
    """The LoRA experts' Function on the seam's arguments (the bf16 and the 4-bit bases): inputs cast to the
    compute dtype, the adapters handed over as parameters where the kernels may write their gradients."""
    dtype = _compute_dtype(x_TD)
    with torch.autocast(x_TD.device.type, enabled=False):
        x, a_gu, a_dn = (t.to(dtype).contiguous() for t in (x_TD, A_gu, A_dn))
        b_gu, b_dn = B_gu.contiguous(), B_dn.contiguous()
        same = (a_gu is A_gu and a_dn is A_dn and b_gu is B_gu and b_dn is B_dn and B_gu.dtype == dtype
                and B_dn.dtype == dtype)  # fmt: skip
        params = (A_gu, B_gu, A_dn, B_dn) if same else None
        folded = _foldable(add_TD, dtype, out_dtype)
        y = _LoRARoutedExperts.apply(x, topk_ids_TK.contiguous(), topk_weights_TK.contiguous(), W_gu, W_dn, a_gu,
                                     b_gu, a_dn, b_dn, folded, scale, dtype, params)  # fmt: skip
    return _with_addend(y, add_TD, folded, out_dtype)


def lora_routed_experts(x_TD, topk_ids_TK, topk_weights_TK, gate_up_proj_EFD, down_proj_EDI, A_gu, B_gu, A_dn,
                        B_dn, scale: float, add_TD: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
    """The triton backend of `kernels.lora_routed_experts` (`anyseek.transforms.lora.LoRAExperts`): the frozen base
    gate_up [E, F, D] and down [E, D, I], adapters A_gu [E, r, D], B_gu [E, F, r], A_dn [E, r, I], B_dn [E, D, r]; the output equals
    `routed_experts` with the effective weights W + scale * B A, which are never formed. Gradients: x,
    topk_weights, the four adapters (the base gets none) and add_TD. add_TD ([T, D] or None) as in
    `routed_experts`: summed inside the combine where it has the dtype computed and returned in. -> [T, D] in x's
    dtype. Under torch.compile: `routed_experts` on the effective weights (the LoRA Function launches its kernels
    itself, not through custom ops that torch.compile could trace)."""
    if torch.compiler.is_compiling():
        gu, dn = (effective_weights(W, A, B, scale) for W, A, B in ((gate_up_proj_EFD, A_gu, B_gu),
                                                                    (down_proj_EDI, A_dn, B_dn)))  # fmt: skip
        return routed_experts(x_TD, topk_ids_TK, topk_weights_TK, gu, dn, add_TD)
    dtype = _compute_dtype(x_TD)
    W_gu, W_dn = (t.detach().to(dtype).contiguous() for t in (gate_up_proj_EFD, down_proj_EDI))
    return _lora_apply(x_TD, topk_ids_TK, topk_weights_TK, W_gu, W_dn, A_gu, B_gu, A_dn, B_dn, scale, add_TD,
                       x_TD.dtype)  # fmt: skip


def _foldable(add_TD: torch.Tensor | None, dtype: torch.dtype, out_dtype: torch.dtype) -> torch.Tensor | None:
    """The addend to sum inside the combine (contiguous): where it has the dtype the experts compute and return
    in; else None (it is added after, `_with_addend`)."""
    return add_TD.contiguous() if add_TD is not None and add_TD.dtype == dtype == out_dtype else None


def _with_addend(y: torch.Tensor, add_TD: torch.Tensor | None, folded: torch.Tensor | None, out_dtype) -> torch.Tensor:
    """The experts' output in out_dtype, plus the addend where the combine did not take it."""
    y = y.to(out_dtype)
    return y + add_TD if add_TD is not None and folded is None else y


def routed_experts(
    x_TD: torch.Tensor,
    topk_ids_TK: torch.Tensor,
    topk_weights_TK: torch.Tensor,
    gate_up_proj_EFD: torch.Tensor,
    down_proj_EDI: torch.Tensor,
    add_TD: torch.Tensor | None = None,
) -> torch.Tensor:
    """Triton routed experts; shapes and maths as `anyseek.kernels.routed_experts`. -> [T, D] in x's dtype.

    x, gate_up_proj and down_proj are computed in one dtype (under autocast: the autocast dtype, as autocast
    would cast them for a matmul); topk_weights may be any float dtype (read as fp32). add_TD ([T, D] or None):
    added to the output; where it has the dtype the experts compute and return in, inside the combine's fp32 sum
    (one rounding, no separate add)."""
    T, D = x_TD.shape
    E, F, D2 = gate_up_proj_EFD.shape
    if topk_ids_TK.shape != topk_weights_TK.shape or topk_ids_TK.dim() != 2 or topk_ids_TK.shape[0] != T:
        raise ValueError(
            f"routed_experts: topk_ids {tuple(topk_ids_TK.shape)} and topk_weights {tuple(topk_weights_TK.shape)} "
            f"must both be [T, K] with T = {T}"
        )
    if D2 != D or F % 2 or down_proj_EDI.shape != (E, D, F // 2):
        raise ValueError(
            f"routed_experts: gate_up_proj {tuple(gate_up_proj_EFD.shape)} must be [E, 2I, D] and down_proj "
            f"{tuple(down_proj_EDI.shape)} [E, D, I] with D = {D}"
        )
    out_dtype = x_TD.dtype
    dtype = _compute_dtype(x_TD)
    with torch.autocast(x_TD.device.type, enabled=False):
        x, gu, dn = (t.to(dtype).contiguous() for t in (x_TD, gate_up_proj_EFD, down_proj_EDI))
        # the weights as parameters, for their gradient destinations (kernels.set_grad_destination); not when
        # torch.compile traces the step (the destination is state outside the traced graph)
        same = gu is gate_up_proj_EFD and dn is down_proj_EDI and not torch.compiler.is_compiling()
        params = (gate_up_proj_EFD, down_proj_EDI) if same else None
        folded = _foldable(add_TD, dtype, out_dtype)  # (the seam checked its shape)
        y = _RoutedExperts.apply(x, topk_ids_TK.contiguous(), topk_weights_TK.contiguous(), gu, dn, params,
                                 folded, torch.is_grad_enabled())  # fmt: skip
    return _with_addend(y, add_TD, folded, out_dtype)


__all__ = ["lora_routed_experts", "routed_experts"]
