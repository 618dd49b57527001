"""The LoRA routed experts: frozen base weights plus per-expert adapters inside the grouped GEMMs of `moe.py` (each
GEMM adds the rows' rank-r term in its epilogue), and the adapters' rank-r weight gradients with their launch
settings. The PyTorch op around them is `kernels/ops/moe.py: lora_routed_experts`.

Shape legend: T tokens, M = T*K routed rows, E experts, D hidden, I expert width, F = 2I, r the adapters' rank.
"""

from __future__ import annotations

import torch

from anyseek.kernels.triton.moe import (
    _config,
    _dh,
    _dx,
    _kn,
    _nk,
    _rank_block,
    _sum_splits,
    _wgrad,
    experts_fwd,
    family,
)

# ---------------------------------------------------------------- LoRA: frozen base, per-expert adapters
#
# Effective weights W_e + B_e A_e (the scale folded into B): each big GEMM takes the base weight and adds L @ R_e in
# its epilogue (`_gemm(low_rank=)`), L = A[row] @ P_e being the rows' rank-r product: read from one dense per-token
# matmul where A is gathered from token rows (u_gu, g_dn: `_per_token`), made by a narrow pass first for the down
# GEMM (u_dn: `_narrow`), accumulated beside the GEMM's own product in its loop over K for dx (g_gu; see "lora_dx"
# in moe.py's _TABLE). L is kept for the adapters' gradients. Nothing [E, F, D]-sized is formed or kept.
# The three products made before their GEMMs rather than in their loops: H200, small, 8k, one MoE layer's LoRA
# experts fwd+bwd (benchmarks/moe.py --lora) 0.889 -> 0.881 ms balanced, 0.943 -> 0.933 skewed; in the training step
# the experts' grouped GEMMs with the narrow passes and the dense per-token products 4.87 -> 4.57 + 0.22 ms
# (docs/benchmarks.md, stop 33).
#   forward   u_gu = x[tok] A_gu^T;  h = x[tok] W_gu^T + u_gu B_gu^T  -> SwiGLU -> act
#             u_dn = act A_dn^T;     y_slot = act W_dn^T + u_dn B_dn^T
#   backward  g_dn = dy[tok] B_dn;   d(act) = dy[tok] W_dn + g_dn A_dn -> dSwiGLU -> dh
#             g_gu = dh B_gu;        dx_slot = dh W_gu + g_gu A_gu
#             dB_gu = dh^T u_gu, dA_gu = g_gu^T x[tok], dB_dn = dy[tok]^T u_dn, dA_dn = g_dn^T act (per expert;
#             act recomputed from h inside that product)


def _per_token(x_TD: torch.Tensor, P_EKR: torch.Tensor) -> torch.Tensor:
    """x @ P_e for every token and every expert at once: [T, E*r], column e*r + j = sum_k x[t, k] P_e[k, j]. One
    dense matmul reads x once; the routed rows' own products (K of the E per token) are then read from it by the
    grouped GEMM's epilogue (`_gemm(l_token=)`) instead of a narrow second dot in its loop over K (which made the
    LoRA experts' GEMMs ~35% slower on an H200). E/K times the needed FLOPs, 2 T D E r: 8.6 GFLOP at `small`, 8k."""
    E, K_red, r = P_EKR.shape
    return x_TD @ P_EKR.permute(1, 0, 2).reshape(K_red, E * r)


def _rank_config(device: torch.device, kind: str, r: int) -> tuple[dict, int]:
    """Tiles and row chunks per expert (`_wgrad`'s split) for the rank-r weight gradients: "wgrad_n" (out
    [E, N1, r]), "wgrad_m" (out [E, r, N2]), "wgrad_m_swiglu" (the same, B recomputed from h)."""
    rb = _rank_block(r)
    base = _config(device, "wgrad")
    if family(device) == "hopper":  # (_RANK_TABLE)
        bk, warps, stages, split = _RANK_TABLE[kind]
        cfg = {**base, "BLOCK_K": bk, "num_warps": warps, "num_stages": stages}  # (base: 128 x 128 tiles)
    else:  # (not measured: the "wgrad" tiles with at most 4 warps and 4 stages, rows in 4 chunks)
        cfg, split = {**base, "num_warps": min(base["num_warps"], 4), "num_stages": min(base["num_stages"], 4)}, 4
    return ({**cfg, "BLOCK_M": rb} if kind != "wgrad_n" else {**cfg, "BLOCK_N": rb}), split


# The rank-r weight gradients on Hopper: (BLOCK_K, warps, stages, row chunks per expert), the other tile side 128.
# Swept alone at `small`, 8k tokens (20 settings x 1/2/4/8 chunks, CUDA-graph replays, H200), us for balanced /
# skewed routing: one chunk is fastest when the experts' rows are even (no partial sums to add up) but leaves the
# busiest expert's rows to one program when they are not (g^T act: 45 / 208 with one chunk), so the chunks stay.
# g^T act (recomputed from h: more work per row) 40.2 / 80.1 with (64, 4, 4, 4) -> 33.8 / 56.9 with (32, 8, 4, 8);
# for the other three (64, 4, 4, 4) was within ~1 us of the best setting at 4 chunks (dh^T u 28.9 / 31.5).
_RANK_TABLE = {"wgrad_n": (64, 4, 4, 4), "wgrad_m": (64, 4, 4, 4), "wgrad_m_swiglu": (32, 8, 4, 8)}


def experts_fwd_lora(x_TD, w_M, gate_up_EFD, down_EDI, adapters, plan, save: bool, add_TD=None):
    """experts_fwd for frozen base weights plus adapters (A_gu [E, r, D], B_gu [E, F, r], A_dn [E, r, I],
    B_dn [E, D, r], the scale in the B's): -> y [T, D] (+ add_TD, as experts_fwd), h [M, F], act [M, I],
    u_gu [M, r], u_dn [M, r]."""
    A_gu, B_gu, A_dn, B_dn = adapters
    M, r = plan[0].numel(), A_gu.shape[1]
    u_gu, u_dn = x_TD.new_empty(M, r), x_TD.new_empty(M, r)
    y_TD, h_MF, act_MI = experts_fwd(x_TD, w_M, gate_up_EFD, down_EDI, plan, save,
                                     low_gu=(u_gu, A_gu, _nk(A_gu), B_gu, _nk(B_gu)),
                                     low_dn=(u_dn, A_dn, _nk(A_dn), B_dn, _nk(B_dn)), add_TD=add_TD,
                                     l_token_gu=_per_token(x_TD, A_gu.transpose(1, 2)) if M else None)  # fmt: skip
    return y_TD, h_MF, act_MI, u_gu, u_dn


def experts_bwd_lora(dy_TD, x_TD, w_M, gate_up_EFD, down_EDI, h_MF, u_gu, u_dn, plan, adapters, out=None):
    """Backward of `experts_fwd_lora`: -> dx [T, D], dw [M] (fp32), dA_gu, dB_gu, dA_dn, dB_dn (the adapters'
    shapes; B's gradient being that of the scaled B). The base weights get none. The SwiGLU output the down
    adapter's gradient needs is recomputed from h inside that product (the forward keeps no [M, I] tensor). out: a
    flat tensor (the adapters' dtype and total size) the four gradients are written into, back to back (the
    trainer's gradient buffer); else a new one."""
    A_gu, B_gu, A_dn, B_dn = adapters
    r, M = A_gu.shape[1], plan[0].numel()
    tok, offs = plan[1], plan[2]
    g_dn, g_gu = x_TD.new_empty(M, r), x_TD.new_empty(M, r)
    dh_MF, dw_M = _dh(dy_TD, w_M, down_EDI, h_MF, plan, low_rank=(g_dn, B_dn, _kn(B_dn), A_dn, _kn(A_dn)),
                      l_token=_per_token(dy_TD, B_dn) if M else None)
    B_gu_rf = B_gu.transpose(1, 2).contiguous()  # [E, r, F]: read k-major in dx's loop (moe.py: "lora_dx")
    dx = _dx(dh_MF, x_TD, gate_up_EFD, plan, low_rank=(g_gu, B_gu_rf, _nk(B_gu_rf), A_gu, _kn(A_gu)))
    # the four gradients (the adapters' order) back to back in one buffer; each product leaves its row chunks'
    # partial sums in one fp32 buffer, added up by one launch
    jobs = [(g_gu, None, x_TD, tok, "wgrad_m", None),  # dA_gu = g_gu^T x
            (dh_MF, None, u_gu, None, "wgrad_n", None),  # dB_gu = dh^T u_gu
            (g_dn, None, h_MF, None, "wgrad_m_swiglu", (w_M, plan[0])),  # dA_dn = g_dn^T act
            (dy_TD, tok, u_dn, None, "wgrad_n", None)]  # dB_dn = dy^T u_dn
    cfgs = [_rank_config(x_TD.device, job[4], r) for job in jobs]
    sizes, splits = [t.numel() for t in adapters], [split for _, split in cfgs]
    if out is not None and (out.dtype != A_gu.dtype or out.numel() != sum(sizes) or out.dim() != 1):
        raise ValueError(f"experts_bwd_lora: out must be a flat {A_gu.dtype} tensor of {sum(sizes)} elements, got "
                         f"{out.dtype} {tuple(out.shape)}")
    flat = A_gu.new_empty(sum(sizes)) if out is None else out
    grads = [v.view(t.shape) for v, t in zip(flat.split(sizes), adapters)]
    parts = torch.empty(sum(s * n for s, n in zip(splits, sizes)), device=x_TD.device, dtype=torch.float32)
    for (a, a_idx, b, b_idx, _, swiglu), grad, (cfg, split), part in zip(
            jobs, grads, cfgs, parts.split([s * n for s, n in zip(splits, sizes)])):  # fmt: skip
        _wgrad(a, a_idx, b, b_idx, grad, offs, cfg, split, swiglu=swiglu, partials=part)
    _sum_splits(parts, flat, sizes, splits)
    return dx, dw_M, *grads


__all__ = ["experts_bwd_lora", "experts_fwd_lora"]
