"""Reference routed experts (pure PyTorch): group tokens by expert, grouped SwiGLU, weighted combine.

Shape legend: T tokens, K experts per token, M = T*K routed rows, E experts, D hidden, I expert intermediate,
F = 2*I (gate rows then up rows).

`lora_routed_experts`: the same on the effective weights W + s B A of LoRA's experts (`effective_weights`).

The bookkeeping is exposed for tests and for other backends:
    x_MD, order_M, counts_E = permute(x_TD, topk_ids_TK, E)   # rows grouped by expert, stable in (token, k)
    y_TD = unpermute(y_MD, order_M, topk_weights_TK)         # y[t] = sum_k w[t,k] * y_MD[row of (t,k)]
    y_TD = combine(y_MD, order_M, T, K)                      # the same for rows already weighted (sorted_weights)
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def permute(x_TD: torch.Tensor, topk_ids_TK: torch.Tensor, num_experts: int):
    """Group the T*K (token, k) slots by expert with a stable sort.

    Returns x_MD (x rows in expert order), order_M (flat slot index t*K + k of each row, int64) and
    counts_E (rows per expert, int64; rows of expert e are contiguous, experts in increasing order).
    """
    ids_M = topk_ids_TK.reshape(-1)
    order_M = torch.argsort(ids_M, stable=True)
    # scatter_add, not bincount: bincount reads its input's max on the host (a device sync, no CUDA graphs)
    counts_E = torch.zeros(num_experts, dtype=torch.int64, device=ids_M.device).scatter_add_(
        0, ids_M, torch.ones_like(ids_M, dtype=torch.int64))
    K = topk_ids_TK.shape[1]
    # index_select, not x[idx]: its backward is an index_add, much cheaper on CPU than an accumulating index_put
    return x_TD.index_select(0, order_M // K), order_M, counts_E


def no_expert_rows(topk_ids_TK: torch.Tensor, topk_weights_TK: torch.Tensor, num_experts: int):
    """Slots whose id is E (no expert: expert parallelism's empty receive rows) as expert E-1 with weight 0: the
    same maths for backends that group every slot (their output rows are 0 for finite inputs)."""
    empty = topk_ids_TK >= num_experts
    return topk_ids_TK.clamp(max=num_experts - 1), topk_weights_TK.masked_fill(empty, 0)


def sorted_weights(topk_weights_TK: torch.Tensor, order_M: torch.Tensor) -> torch.Tensor:
    """The routing weight of each routed row, in the expert order of `permute`: fp32 [M]."""
    return topk_weights_TK.reshape(-1).index_select(0, order_M).float()


def combine(y_MD: torch.Tensor, order_M: torch.Tensor, T: int, K: int) -> torch.Tensor:
    """Sum each token's K rows back to it, in fp32: out[t] = sum_k y_MD[row(t,k)]. -> fp32 [T, D]."""
    out_TD = torch.zeros(T, y_MD.shape[-1], dtype=torch.float32, device=y_MD.device)
    return out_TD.index_add_(0, order_M // K, y_MD.float())


def unpermute(y_MD: torch.Tensor, order_M: torch.Tensor, topk_weights_TK: torch.Tensor) -> torch.Tensor:
    """Weighted combine back to tokens, accumulated in fp32: y[t] = sum_k w[t,k] * y_MD[row(t,k)]. -> fp32 [T, D]."""
    T, K = topk_weights_TK.shape
    return combine(y_MD.float() * sorted_weights(topk_weights_TK, order_M)[:, None], order_M, T, K)


def grouped_swiglu(
    x_MD: torch.Tensor,
    counts: list[int],
    gate_up_proj_EFD: torch.Tensor,
    down_proj_EDI: torch.Tensor,
    w_M: torch.Tensor | None = None,
) -> torch.Tensor:
    """Rows grouped by expert (counts[e] rows for expert e) -> down_e(w * silu(gate_e x) * up_e x), [M, D].

    w_M (optional, fp32 [M]) scales each row's activation before the down projection: the routing weight applied on
    the narrow [M, I] side instead of the [M, D] output (the same product, as down_e is linear), rounded once to
    x's dtype. A Python loop over experts (not tokens); empty experts are skipped.
    """
    I = down_proj_EDI.shape[-1]
    # unbind, not [e]: the backward of E selects would build E full-size [E, F, D] gradients; unbind's is one stack
    gate_up_FD, down_DI = gate_up_proj_EFD.unbind(0), down_proj_EDI.unbind(0)
    w_groups = w_M.split(counts) if w_M is not None else [None] * len(counts)
    outs = []
    for e, (rows, w_R) in enumerate(zip(x_MD.split(counts), w_groups)):
        if rows.shape[0] == 0:
            continue
        h_RF = rows @ gate_up_FD[e].t()
        act_RI = F.silu(h_RF[:, :I]) * h_RF[:, I:]
        if w_R is not None:
            act_RI = (act_RI * w_R[:, None]).to(act_RI.dtype)
        outs.append(act_RI @ down_DI[e].t())
    if not outs:
        return x_MD.new_zeros(0, down_proj_EDI.shape[1])
    return torch.cat(outs, dim=0)


def routed_experts(
    x_TD: torch.Tensor,
    topk_ids_TK: torch.Tensor,
    topk_weights_TK: torch.Tensor,
    gate_up_proj_EFD: torch.Tensor,
    down_proj_EDI: torch.Tensor,
    add_TD: torch.Tensor | None = None,
) -> torch.Tensor:
    """y[t] = sum_k w[t,k] * down_e(silu(gate_e x[t]) * up_e x[t]) (+ add[t]), e = topk_ids[t,k]. -> [T, D] in x's
    dtype (promoted with add's).

    One host sync (the per-expert row counts).
    """
    E = gate_up_proj_EFD.shape[0]
    if topk_ids_TK.shape != topk_weights_TK.shape or topk_ids_TK.shape[0] != x_TD.shape[0]:
        raise ValueError(
            f"routed_experts: topk_ids {tuple(topk_ids_TK.shape)} and topk_weights {tuple(topk_weights_TK.shape)} "
            f"must both be [T, K] with T = {x_TD.shape[0]}"
        )
    topk_ids_TK, topk_weights_TK = no_expert_rows(topk_ids_TK, topk_weights_TK, E)
    x_MD, order_M, counts_E = permute(x_TD, topk_ids_TK, E)
    w_M = sorted_weights(topk_weights_TK, order_M)
    y_MD = grouped_swiglu(x_MD, counts_E.tolist(), gate_up_proj_EFD, down_proj_EDI, w_M)  # rows already weighted
    y_TD = combine(y_MD, order_M, *topk_ids_TK.shape).to(x_TD.dtype)
    return y_TD if add_TD is None else y_TD + add_TD


def effective_weights(W_EOI: torch.Tensor, A_ERI: torch.Tensor, B_EOR: torch.Tensor, scale: float) -> torch.Tensor:
    """W + scale * B A per expert [E, O, I] in W's dtype (the adapters cast to it first): one batched matmul, a LoRA
    expert's weight as the model would read it (`transforms.lora.LoRAExperts.gate_up_proj`)."""
    return torch.baddbmm(W_EOI, B_EOR.to(W_EOI.dtype), A_ERI.to(W_EOI.dtype), alpha=scale)


def lora_routed_experts(x_TD, topk_ids_TK, topk_weights_TK, gate_up_EFD, down_EDI, A_gu, B_gu, A_dn, B_dn,
                        scale: float, add_TD: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
    """`kernels.lora_routed_experts`'s twin: `routed_experts` on the effective weights W + scale * B A (adapters
    A_gu [E, r, D], B_gu [E, F, r], A_dn [E, r, I], B_dn [E, D, r]); autograd forms the [E, F, D] gradient of the
    effective weights and two batched matmuls reduce it to the adapters'."""
    gate_up = effective_weights(gate_up_EFD, A_gu, B_gu, scale)
    down = effective_weights(down_EDI, A_dn, B_dn, scale)
    return routed_experts(x_TD, topk_ids_TK, topk_weights_TK, gate_up, down, add_TD)
