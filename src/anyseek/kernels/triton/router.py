"""DeepSeek's group-limited routing top-k in one Triton kernel.

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
def _route_topk_kernel(S, BIAS, IDS, T, stride_s, E, X, G: tl.constexpr, TOPG: tl.constexpr, K: tl.constexpr,
                       TOP2: tl.constexpr, BLOCK_T: tl.constexpr, BE: tl.constexpr, BG: tl.constexpr):  # fmt: skip
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    rmask = rows < T
    cols = tl.arange(0, BE)
    cmask = cols < E
    s = tl.load(S + rows.to(tl.int64)[:, None] * stride_s + cols[None, :], mask=rmask[:, None] & cmask[None, :],
                other=0.0).to(tl.float32)  # fmt: skip
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
    for k in tl.static_range(K):
        e = tl.minimum(tl.argmax(choice, axis=1), E - 1)
        tl.store(IDS + rows.to(tl.int64) * K + k, e.to(tl.int64), mask=rmask)
        choice = tl.where(cols[None, :] == e[:, None], float("-inf"), choice)


@torch.no_grad()
def route_topk(scores_TE: torch.Tensor, bias_E: torch.Tensor, top_k: int, n_group: int, topk_group: int,
               top2_groups: bool) -> torch.Tensor:  # fmt: skip
    """As `kernels.reference.router.route_topk`."""
    if torch.compiler.is_compiling():
        from anyseek.kernels.reference.router import route_topk as reference

        return reference(scores_TE, bias_E, top_k, n_group, topk_group, top2_groups)
    T, E = scores_TE.shape
    s = scores_TE if scores_TE.stride(-1) == 1 else scores_TE.contiguous()
    ids = torch.empty(T, top_k, dtype=torch.int64, device=s.device)
    if T == 0:
        return ids
    BE = triton.next_power_of_2(E)
    block_t = max(1, min(128, ELEMENTS // BE))
    _route_topk_kernel[(triton.cdiv(T, block_t),)](
        s, bias_E.contiguous(), ids, T, s.stride(0), E, E // n_group, G=n_group, TOPG=topk_group, K=top_k,
        TOP2=top2_groups, BLOCK_T=block_t, BE=BE, BG=triton.next_power_of_2(n_group), num_warps=4,
    )  # fmt: skip
    return ids


def available(example: torch.Tensor) -> tuple[bool, str]:
    from anyseek.kernels.triton.check import available as triton_available

    return triton_available(example[..., :1])
