"""Multi-token prediction (DeepSeek-V3 section 2.2), for training.

Module k (depth d = k + 1) at position i: h'_i = eh_proj([enorm(Emb(t_{i+d})) ; hnorm(h_i^{d-1})]) (embedding
first, as the official checkpoints are laid out), h_i^d = DecoderLayer(h'_i), logits = lm_head(shared_head.norm(h_i^d))
predict t_{i+d+1}. h^0 is the main model's last hidden state after its final norm (model.norm), the state that
vLLM and SGLang hand to the official MTP weights. Embedding and output head are the main model's. In a packed
batch the shifted inputs and labels never cross a document end.

Shape legend: T tokens, D hidden.
"""

from __future__ import annotations

import torch
from torch import nn

from anyseek.constants import IGNORE_INDEX
from anyseek.model.block import DecoderLayer
from anyseek.model.config import ModelConfig
from anyseek.model.layout import PackedLayout
from anyseek.model.moe import RoutingStats
from anyseek.model.norm import RMSNorm


class SharedHead(nn.Module):
    """Only the norm is MTP's own; the head itself is the main model's lm_head."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class MTPModule(DecoderLayer):
    """A decoder layer (its parameters sit directly at `mtp.{k}.*`) plus enorm, hnorm, eh_proj, shared_head.norm."""

    def __init__(self, config: ModelConfig, k: int):
        super().__init__(config, layer_idx=config.num_hidden_layers + k)
        D = config.hidden_size
        self.enorm = RMSNorm(D, config.rms_norm_eps)
        self.hnorm = RMSNorm(D, config.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * D, D, bias=False)
        self.shared_head = SharedHead(config)

    def forward(  # type: ignore[override]
        self,
        h_prev_TD: torch.Tensor,
        emb_TD: torch.Tensor,
        layout: PackedLayout,
        inside_T: torch.Tensor | None = None,
        want_balance_loss: bool = False,
        num_segments: float | torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, RoutingStats | None]:
        """h^{d-1} [T, D], Emb(t_{i+d}) [T, D] -> (h^d [T, D] before shared_head.norm, routing stats).
        inside_T (bool [T]): the positions whose input is still inside their document; the filler positions past
        each document end are routed like any token but counted in neither the expert load nor the balance loss,
        so a document of at most d tokens has no term in it. num_segments: the balance loss's denominator (default
        this batch's documents longer than d; `count_segments`)."""
        h_TD = self.eh_proj(torch.cat([self.enorm(emb_TD), self.hnorm(h_prev_TD)], dim=-1))
        return super().forward(h_TD, layout, inside_T, want_balance_loss, num_segments=num_segments)


def shift_in_documents(
    input_ids_T: torch.Tensor, targets_T: torch.Tensor, layout: PackedLayout, depth: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inputs and labels of MTP depth d for a packed batch: ids[i] = input_ids[i+d] = t_{i+d} and
    labels[i] = targets[i+d] = t_{i+d+1} while i+d is in i's document; past the document end ids are 0 and
    labels IGNORE_INDEX. input_ids, targets [T] -> (ids [T], labels [T], inside bool [T])."""
    T = input_ids_T.shape[0]
    inside_T = layout.positions + depth < layout.doc_lens[layout.doc_ids]
    src_T = (torch.arange(T, device=input_ids_T.device) + depth).clamp(max=max(T - 1, 0))
    ids_T = torch.where(inside_T, input_ids_T[src_T], torch.zeros_like(input_ids_T))
    labels_T = torch.where(inside_T, targets_T[src_T], torch.full_like(targets_T, IGNORE_INDEX))
    return ids_T, labels_T, inside_T


def count_targets(targets: torch.Tensor, cu_seqlens: torch.Tensor | None, mtp_depths: int) -> list[int]:
    """How many positions of a batch are trained on: [next-token targets, MTP depth 1 labels, ..., depth D labels].

    targets: packed [T] with cu_seqlens [B+1] (None: one document) or [B, S] rows (cu_seqlens None). Meant for the
    CPU copy of a batch before it goes to the device (one small sum per depth, no device sync). A trainer that
    accumulates micro-batches passes the step's totals to the model as `num_targets`, so that the loss is the mean
    over every target of the step, not a mean of per-micro-batch means."""
    if targets.dim() == 2:
        B, S = targets.shape
        cu_seqlens = torch.arange(0, (B + 1) * S, S)
        targets = targets.reshape(-1)
    T = targets.shape[0]
    if cu_seqlens is None:
        cu_seqlens = torch.tensor([0, T])
    valid_T = targets != IGNORE_INDEX
    counts = [int(valid_T.sum())]
    if mtp_depths:
        # the depth-d label of position t is targets[t + d] when t + d is in t's document: counted once per target j
        # that is valid and at least d tokens into its document
        cu = cu_seqlens.to(torch.int64)
        pos_T = torch.arange(T) - torch.repeat_interleave(cu[:-1], cu.diff(), output_size=T)
        for depth in range(1, mtp_depths + 1):
            counts.append(int((valid_T & (pos_T >= depth)).sum()))
    return counts


def count_segments(targets: torch.Tensor, cu_seqlens: torch.Tensor | None, mtp_depths: int) -> list[int]:
    """How many segments of a batch have a term in the sequence-wise balance loss: [main MoE layers, MTP depth 1,
    ..., depth D]. The main layers count every non-empty segment; depth d counts the segments longer than d (the
    others hold only filler positions there, which the balance loss does not count; `shift_in_documents`).

    targets (only its shape is read) and cu_seqlens as for `count_targets`, meant like it for the CPU copy of a
    batch. A trainer passes the step's totals over micro-batches and ranks to the model as `num_segments`, so that
    the balance loss is the mean over every segment of the step, not a mean of per-micro-batch means."""
    if targets.dim() == 2:
        B, S = targets.shape
        lens_B = torch.full((B,), S)
    elif cu_seqlens is None:
        lens_B = torch.tensor([targets.shape[0]])
    else:
        lens_B = cu_seqlens.to(torch.int64).diff()
    return [int((lens_B > depth).sum()) for depth in range(mtp_depths + 1)]
