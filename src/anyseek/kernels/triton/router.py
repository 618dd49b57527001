"""DeepSeek's group-limited routing top-k in one Triton kernel (`route_topk`), and the router's whole decision from
its logits for inference (`route_weights`: the scores, the top-k and the chosen experts' weights in the same kernel).

PyTorch's path is an add (the selection bias), three `topk` calls (each group's best two, the best groups, the best
experts among them; each a radix sort, ~27 us at 8,192 tokens on an H100), a scatter and a masked fill: ~8 kernels
per MoE layer. Here one program takes BLOCK_T tokens with all their E scores in registers, and every selection is an
argmax over a row followed by masking the winner: G group scores (their best one or two), TOPG rounds over the
groups, K rounds over the experts. The ids are those of `kernels.reference.router` up to order (and ties, which the
reference breaks as torch.topk does). A NaN score counts as -inf, so ids always lie in [0, E).

Shape legend: T tokens, E experts (BE: the next power of two), G groups of X experts each, K experts per token.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

ELEMENTS = 2048  # scores per program (BLOCK_T * BE): ~16 per thread at 4 warps


@triton.jit
def _route_topk_kernel(S, BIAS, IDS, W, scale, T, stride_s, E, X, G: tl.constexpr, TOPG: tl.constexpr,
                       K: tl.constexpr, TOP2: tl.constexpr, BLOCK_T: tl.constexpr, BE: tl.constexpr,
                       BG: tl.constexpr, SCORE: tl.constexpr, WEIGHTS: tl.constexpr, NORM: tl.constexpr,
                       BK: tl.constexpr):  # fmt: skip
    """SCORE: what S holds: 0 the scores, 1 logits whose sigmoid, 2 logits whose softmax over E are the scores.
    WEIGHTS: also each chosen expert's score into W (normalized over the K with NORM) times scale."""
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    rmask = rows < T
    cols = tl.arange(0, BE)
    cmask = cols < E
    s = tl.load(S + rows.to(tl.int64)[:, None] * stride_s + cols[None, :], mask=rmask[:, None] & cmask[None, :],
                other=0.0).to(tl.float32)  # fmt: skip
    if SCORE == 1:
        s = 1.0 / (1.0 + tl.exp(-s))
    elif SCORE == 2:
        s = tl.where(cmask[None, :], s, float("-inf"))
        s = tl.exp(s - tl.max(s, axis=1)[:, None])
        s = s / tl.sum(s, axis=1)[:, None]
    b = tl.load(BIAS + cols, mask=cmask, other=0.0).to(tl.float32)
    choice = s + b[None, :]
    choice = tl.where(cmask[None, :] & (choice == choice), choice, float("-inf"))  # padding and NaN: never chosen
    if G > 1:
        grp = cols // X
        gcols = tl.arange(0, BG)
        gscore = tl.full([BLOCK_T, BG], float("-inf"), tl.float32)
        for j in tl.static_range(G):
            v = tl.where((grp == j)[None, :], choice, float("-inf"))
            best = tl.max(v, axis=1)
            if TOP2:
                first = tl.argmax(v, axis=1)
                best = best + tl.max(tl.where(cols[None, :] == first[:, None], float("-inf"), v), axis=1)
            gscore = tl.where(gcols[None, :] == j, best[:, None], gscore)
        keep = tl.zeros([BLOCK_T, BE], dtype=tl.int32)
        for _ in tl.static_range(TOPG):
            g = tl.argmax(gscore, axis=1)
            keep = tl.where(grp[None, :] == g[:, None], 1, keep)
            gscore = tl.where(gcols[None, :] == g[:, None], float("-inf"), gscore)
        choice = tl.where(keep > 0, choice, float("-inf"))
    kcols = tl.arange(0, BK)
    w = tl.zeros([BLOCK_T, BK], dtype=tl.float32)
    for k in tl.static_range(K):
        e = tl.minimum(tl.argmax(choice, axis=1), E - 1)
        tl.store(IDS + rows.to(tl.int64) * K + k, e.to(tl.int64), mask=rmask)
        if WEIGHTS:
            w_k = tl.sum(tl.where(cols[None, :] == e[:, None], s, 0.0), axis=1)
            w = tl.where(kcols[None, :] == k, w_k[:, None], w)
        choice = tl.where(cols[None, :] == e[:, None], float("-inf"), choice)
    if WEIGHTS:
        if NORM:
            w = w / (tl.sum(w, axis=1)[:, None] + 1e-20)
        tl.store(W + rows.to(tl.int64)[:, None] * K + kcols[None, :], w * scale,
                 mask=rmask[:, None] & (kcols[None, :] < K))  # fmt: skip


@torch.no_grad()
def route_topk(scores_TE: torch.Tensor, bias_E: torch.Tensor, top_k: int, n_group: int, topk_group: int,
               top2_groups: bool) -> torch.Tensor:  # fmt: skip
    """As `kernels.reference.router.route_topk`."""
    if torch.compiler.is_compiling():
        from anyseek.kernels.reference.router import route_topk as reference

        return reference(scores_TE, bias_E, top_k, n_group, topk_group, top2_groups)
    return _launch(scores_TE, bias_E, top_k, n_group, topk_group, top2_groups)[0]


def _launch(s_TE: torch.Tensor, bias_E: torch.Tensor, top_k: int, n_group: int, topk_group: int, top2_groups: bool,
            score: int = 0, weights: bool = False, norm: bool = False, scale: float = 1.0):  # fmt: skip
    T, E = s_TE.shape
    s = s_TE if s_TE.stride(-1) == 1 else s_TE.contiguous()
    ids = torch.empty(T, top_k, dtype=torch.int64, device=s.device)
    w = torch.empty(T, top_k, dtype=torch.float32, device=s.device) if weights else ids
    if T == 0:
        return ids, w
    BE = triton.next_power_of_2(E)
    block_t = max(1, min(128, ELEMENTS // BE))
    _route_topk_kernel[(triton.cdiv(T, block_t),)](
        s, bias_E.contiguous(), ids, w, float(scale), T, s.stride(0), E, E // n_group, G=n_group, TOPG=topk_group,
        K=top_k, TOP2=top2_groups, BLOCK_T=block_t, BE=BE, BG=triton.next_power_of_2(n_group), SCORE=score,
        WEIGHTS=weights, NORM=norm, BK=triton.next_power_of_2(top_k), num_warps=4,
    )  # fmt: skip
    return ids, w


@torch.no_grad()
def route_weights(logits_TE: torch.Tensor, bias_E: torch.Tensor, top_k: int, n_group: int, topk_group: int,
                  top2_groups: bool, sigmoid: bool, norm_topk_prob: bool, scale: float
                  ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """As `kernels.reference.router.route_weights`, in one kernel: the scores, the selection and the weights."""
    if torch.compiler.is_compiling():
        from anyseek.kernels.reference.router import route_weights as reference

        return reference(logits_TE, bias_E, top_k, n_group, topk_group, top2_groups, sigmoid, norm_topk_prob, scale)
    return _launch(logits_TE, bias_E, top_k, n_group, topk_group, top2_groups, 1 if sigmoid else 2, True,
                   norm_topk_prob, scale)  # fmt: skip


def available(example: torch.Tensor) -> tuple[bool, str]:
    from anyseek.kernels.triton.check import available as triton_available

    return triton_available(example[..., :1])
