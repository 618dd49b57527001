"""DeepSeekMoE: shared experts + routed experts with group-limited top-k routing (sigmoid or softmax scores).

Routing (DeepSeek-V3): s = sigmoid(x W^T) in fp32; the bias b (e_score_correction_bias, updated outside the
optimizer by auxiliary-loss-free balancing) is added for *selection only*: groups are ranked by the sum of their
top-2 biased scores (softmax scoring: the max), the best topk_group groups are kept, the top-k experts among them
are chosen, and the weights are the unbiased scores of those experts, normalised to sum 1 when norm_topk_prob,
times routed_scaling_factor. The routed computation goes through `anyseek.kernels.routed_experts`.

Shape legend: T tokens, D hidden, E routed experts, K experts per token, G groups, I expert intermediate,
B documents.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from anyseek import kernels
from anyseek.model.concat import fused_linear
from anyseek.model.config import ModelConfig
from anyseek.model.layout import PackedLayout
from anyseek.model.matmul import linear_fp32


@dataclass(frozen=True)
class RoutingStats:
    """What one MoE layer reports about a forward: load_E float [E], the counted tokens routed to each expert (for
    the routing-bias update), and its sequence-wise balance loss (fp32 scalar; None when not asked for)."""

    load_E: torch.Tensor
    balance_loss: torch.Tensor | None = None


class MLP(nn.Module):
    """SwiGLU feed-forward: down(silu(gate x) * up x). Dense layers and shared experts."""

    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def joined_weights(self) -> list[tuple[torch.Tensor, ...]]:
        """Weights the forward uses side by side (`model/concat.py`)."""
        return [(self.gate_proj.weight, self.up_proj.weight)]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # gate and up read the same x: one matmul (and one per gradient) on their joined weights, [gate | up] out
        gu = fused_linear(x, [self.gate_proj, self.up_proj])
        return self.down_proj(kernels.swiglu(gu))


class Router(nn.Module):
    """The gate: weight [E, D] and the fp32 selection bias e_score_correction_bias [E] (a persistent buffer)."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        E = config.n_routed_experts
        self.top_k, self.n_group, self.topk_group = config.num_experts_per_tok, config.n_group, config.topk_group
        self.scoring_func, self.norm_topk_prob = config.scoring_func, config.norm_topk_prob
        self.routed_scaling_factor = config.routed_scaling_factor
        self.weight = nn.Parameter(torch.empty(E, config.hidden_size))
        self.register_buffer("e_score_correction_bias", torch.zeros(E, dtype=torch.float32))

    def forward(self, x_TD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [T, D] -> scores fp32 [T, E] (unbiased; for the balance loss), topk_ids [T, K], weights fp32 [T, K]."""
        logits_TE = self._logits(x_TD)
        scores_TE = logits_TE.sigmoid() if self.scoring_func == "sigmoid" else logits_TE.softmax(dim=-1)
        topk_ids_TK = kernels.route_topk(scores_TE.detach(), self.e_score_correction_bias, self.top_k, self.n_group,
                                         self.topk_group, self.scoring_func == "sigmoid")  # group-limited top-k
        weights_TK = scores_TE.gather(1, topk_ids_TK)
        if self.norm_topk_prob:
            weights_TK = weights_TK / (weights_TK.sum(dim=-1, keepdim=True) + 1e-20)
        return scores_TE, topk_ids_TK, weights_TK * self.routed_scaling_factor

    @torch.no_grad()
    def choose(self, x_TD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`forward`'s topk_ids and weights for inference (no scores, no gradient): the linear, then the rest in one
        kernel on GPUs (`kernels.route_weights`) where `forward` runs about seven."""
        sigmoid = self.scoring_func == "sigmoid"
        return kernels.route_weights(self._logits(x_TD), self.e_score_correction_bias, self.top_k, self.n_group,
                                     self.topk_group, sigmoid, sigmoid, self.norm_topk_prob,
                                     self.routed_scaling_factor)  # fmt: skip

    def _logits(self, x_TD: torch.Tensor) -> torch.Tensor:
        """x [T, D] -> fp32 [T, E]; routing stays fp32 under autocast (F.linear(x.float(), w.float()), on tensor
        cores for bf16: `linear_fp32`)."""
        with torch.autocast(device_type=x_TD.device.type, enabled=False):
            return linear_fp32(x_TD, self.weight)


def addend(add_TD: torch.Tensor | Callable[[], torch.Tensor] | None) -> torch.Tensor | None:
    """The experts' addend: a tensor, None, or a function that computes it (the shared experts), called once."""
    return add_TD() if callable(add_TD) else add_TD


class Experts(nn.Module):
    """Routed experts' weights, stacked: gate_up_proj [E, 2I, D] (rows :I gate, I: up), down_proj [E, D, I].
    forward(x, topk_ids, topk_weights, add_TD=None): modules that replace it from outside (LoRA, expert
    parallelism) take the same arguments. add_TD, added to the output: a [T, D] tensor, or a function computing it
    (the shared experts), which the module calls once, where it chooses (`addend`): expert parallelism calls it
    while its rows travel to the other ranks."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        E, D, I = config.n_routed_experts, config.hidden_size, config.moe_intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(E, 2 * I, D))
        self.down_proj = nn.Parameter(torch.empty(E, D, I))

    def forward(self, x_TD: torch.Tensor, topk_ids_TK: torch.Tensor, topk_weights_TK: torch.Tensor,
                add_TD: torch.Tensor | Callable[[], torch.Tensor] | None = None) -> torch.Tensor:  # fmt: skip
        return kernels.routed_experts(x_TD, topk_ids_TK, topk_weights_TK, self.gate_up_proj, self.down_proj,
                                      addend(add_TD))


class MoE(nn.Module):
    """Shared experts (one MLP of width n_shared * I) + routed experts. Returns the output and this layer's
    RoutingStats: statistics travel back explicitly, never through a shared object."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.n_experts, self.top_k = config.n_routed_experts, config.num_experts_per_tok
        self.gate = Router(config)
        self.experts = Experts(config)
        if config.n_shared_experts:
            self.shared_experts = MLP(config.hidden_size, config.moe_intermediate_size * config.n_shared_experts)

    @property
    def input_copies(self) -> int:
        """How many modules read the input x (the router, the routed experts, the shared experts if any): `forward`
        takes x as one tensor or as that many copies, whose gradients the norm before it can sum in its own
        backward (`RMSNorm.add_forward(copies=)`)."""
        return 3 if hasattr(self, "shared_experts") else 2

    def forward(
        self,
        x_TD: torch.Tensor | Sequence[torch.Tensor],
        layout: PackedLayout | None = None,
        token_mask_T: torch.Tensor | None = None,
        want_balance_loss: bool = False,
        num_segments: float | torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, RoutingStats]:
        """x [T, D] -> (y [T, D], stats). x may also be `input_copies` tensors of the same value, read by the router,
        the routed experts and the shared experts in that order. token_mask_T (bool [T], default all): the tokens
        that count in the expert load and the balance loss (MTP passes False for its filler positions past each
        document end); every token is still routed. The balance loss needs `layout` (its sequences are the layout's
        documents); num_segments is its denominator (see `sequence_balance_loss`)."""
        xs = (x_TD,) * self.input_copies if isinstance(x_TD, torch.Tensor) else tuple(x_TD)
        if len(xs) != self.input_copies:
            raise ValueError(f"MoE.forward: x as {len(xs)} copies, expected 1 or {self.input_copies}")
        x_TD = xs[0]
        scores_TE, topk_ids_TK, weights_TK = self.gate(x_TD)
        # the shared experts' output is added by the experts (summed with the routed rows where the kernel can), and
        # computed when they ask (expert parallelism: while its rows travel); fp32 routing weights, output in x's dtype
        shared = (lambda: self.shared_experts(xs[2])) if hasattr(self, "shared_experts") else None
        y_TD = self.experts(xs[1], topk_ids_TK, weights_TK, add_TD=shared)
        with torch.no_grad():  # index_add, not bincount: no host sync on GPUs
            counted_M = (
                torch.ones(topk_ids_TK.numel(), device=x_TD.device) if token_mask_T is None
                else token_mask_T.float().repeat_interleave(self.top_k)
            )
            load_E = torch.zeros(self.n_experts, device=x_TD.device).index_add_(0, topk_ids_TK.reshape(-1), counted_M)
        balance = None
        if want_balance_loss:
            if layout is None:
                raise ValueError("the sequence-wise balance loss needs the batch layout (its documents)")
            balance = sequence_balance_loss(scores_TE, topk_ids_TK, layout, token_mask_T, num_segments)
        return y_TD, RoutingStats(load_E, balance)


def sequence_balance_loss(
    scores_TE: torch.Tensor,
    topk_ids_TK: torch.Tensor,
    layout: PackedLayout,
    token_mask_T: torch.Tensor | None = None,
    num_segments: float | torch.Tensor | None = None,
) -> torch.Tensor:
    """DeepSeek-V3's sequence-wise balance loss (without alpha), one sequence = one packed document (segment):

    f[b,e] = E / (K * L_b) * #{t in b routed to e},  P[b,e] = mean_{t in b} s[t,e] / sum_j s[t,j],
    loss = sum_b sum_e f[b,e] * P[b,e] / num_segments.
    L_b and the sums run over the tokens of b that token_mask_T counts (all by default); a document without counted
    tokens adds nothing. num_segments (default: this batch's documents with counted tokens, which makes the loss a
    mean over them, 1.0 when perfectly balanced; at least 1): a trainer that accumulates micro-batches passes the
    step's count over every micro-batch and rank (`anyseek.model.mtp.count_segments`), so that the summed loss is
    the mean over every segment of the step however the step is split, as the next-token loss is over targets.
    A fp32 scalar tensor (e.g. a CUDA graph's static input) keeps it free of host syncs.
    """
    T, E = scores_TE.shape
    K = topk_ids_TK.shape[1]
    B = layout.doc_lens.numel()
    mask_T1 = (
        scores_TE.new_ones(T, 1) if token_mask_T is None else token_mask_T.to(scores_TE.dtype)[:, None]
    )
    lens_B = scores_TE.new_zeros(B).index_add(0, layout.doc_ids, mask_T1[:, 0])
    lens_B1 = lens_B.clamp(min=1)[:, None]
    probs_TE = scores_TE / scores_TE.sum(dim=-1, keepdim=True) * mask_T1
    P_BE = scores_TE.new_zeros(B, E).index_add(0, layout.doc_ids, probs_TE) / lens_B1
    with torch.no_grad():
        hits_TE = scores_TE.new_zeros(T, E).scatter_(1, topk_ids_TK, 1.0) * mask_T1
        f_BE = scores_TE.new_zeros(B, E).index_add(0, layout.doc_ids, hits_TE) * (E / K) / lens_B1
    # a document without counted tokens has f = P = 0: its term is 0 and so is its gradient
    return (f_BE * P_BE).sum(dim=-1).sum() / _segments(lens_B, num_segments)


def _segments(lens_B: torch.Tensor, num_segments: float | torch.Tensor | None) -> torch.Tensor:
    """The balance loss's denominator: the caller's count or this batch's documents with counted tokens (lens_B
    fp32 [B]), as a fp32 scalar, at least 1."""
    if num_segments is None:
        return (lens_B > 0).to(lens_B.dtype).sum().clamp(min=1)
    return torch.as_tensor(num_segments, dtype=lens_B.dtype, device=lens_B.device).clamp(min=1)
