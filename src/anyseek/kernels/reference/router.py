"""Pure-PyTorch twin of the routing top-k kernel (`kernels.route_topk`): DeepSeek's group-limited top-k."""

from __future__ import annotations

import torch


@torch.no_grad()
def route_topk(scores_TE: torch.Tensor, bias_E: torch.Tensor, top_k: int, n_group: int, topk_group: int,
               top2_groups: bool) -> torch.Tensor:  # fmt: skip
    """The experts each token is sent to: top_k of scores + bias among the topk_group best of n_group groups (a
    group's score: the sum of its best two when top2_groups (V3), else its best (V2)) -> ids [T, K] int64, unsorted."""
    choice_TE = scores_TE + bias_E
    if n_group > 1:
        T, E = choice_TE.shape
        choice_TGX = choice_TE.view(T, n_group, E // n_group)
        group_TG = choice_TGX.topk(2, dim=-1)[0].sum(dim=-1) if top2_groups else choice_TGX.amax(dim=-1)
        keep_TG = torch.zeros_like(group_TG, dtype=torch.bool)
        keep_TG.scatter_(1, group_TG.topk(topk_group, dim=-1, sorted=False)[1], True)
        choice_TE = choice_TGX.masked_fill(~keep_TG[:, :, None], float("-inf")).view(T, E)
    return choice_TE.topk(top_k, dim=-1, sorted=False)[1]
