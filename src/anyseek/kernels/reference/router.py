"""Pure-PyTorch twins of the routing kernels: `kernels.route_topk` (DeepSeek's group-limited top-k) and
`kernels.route_weights` (the router's whole decision from its logits, for inference)."""

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


@torch.no_grad()
def route_weights(logits_TE: torch.Tensor, bias_E: torch.Tensor, top_k: int, n_group: int, topk_group: int,
                  top2_groups: bool, sigmoid: bool, norm_topk_prob: bool, scale: float
                  ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """`model.moe.Router.forward` after its logits: scores (sigmoid or softmax in fp32), ids by `route_topk`, the
    weights the chosen experts' scores (normalized to sum 1 when norm_topk_prob) times scale -> (ids [T, K] int64,
    weights [T, K] fp32)."""
    logits_TE = logits_TE.float()
    scores_TE = logits_TE.sigmoid() if sigmoid else logits_TE.softmax(dim=-1)
    ids_TK = route_topk(scores_TE, bias_E, top_k, n_group, topk_group, top2_groups)
    weights_TK = scores_TE.gather(1, ids_TK)
    if norm_topk_prob:
        weights_TK = weights_TK / (weights_TK.sum(dim=-1, keepdim=True) + 1e-20)
    return ids_TK, weights_TK * scale
