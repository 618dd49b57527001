"""What every layer needs to know about a packed batch, computed once per forward.

Shape legend: T tokens, B documents, R rope dim.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class Packing:
    """A packed batch of B documents: cu_seqlens int32 [B+1], positions [T] (restart at 0 in every document),
    doc_ids [T] (document of each token), doc_lens [B], cos/sin fp32 [T, R/2]. Layers append MoE statistics to
    `expert_load` (float [E] per MoE layer) and `balance_losses` (scalar per MoE layer) when `collect` is set."""

    cu_seqlens: torch.Tensor
    max_seqlen: int
    positions: torch.Tensor
    doc_ids: torch.Tensor
    doc_lens: torch.Tensor
    cos: torch.Tensor | None = None
    sin: torch.Tensor | None = None
    want_balance_loss: bool = False
    expert_load: list[torch.Tensor] = field(default_factory=list)
    balance_losses: list[torch.Tensor] = field(default_factory=list)

    @classmethod
    def build(cls, cu_seqlens: torch.Tensor, num_tokens: int, max_seqlen: int | None = None) -> Packing:
        """From document starts. One host sync (checks cu_seqlens, finds max_seqlen); no per-token Python."""
        if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
            raise ValueError(f"cu_seqlens must be 1-D with at least 2 entries, got shape {tuple(cu_seqlens.shape)}")
        cu = cu_seqlens.to(torch.int64)
        doc_lens = cu[1:] - cu[:-1]
        first, last, shortest, longest = torch.stack([cu[0], cu[-1], doc_lens.min(), doc_lens.max()]).tolist()
        if first != 0 or last != num_tokens or shortest < 0:
            raise ValueError(
                f"cu_seqlens must start at 0, never decrease and end at the token count {num_tokens}; "
                f"got {first}..{last}{' with a decreasing step' if shortest < 0 else ''}"
            )
        B = doc_lens.numel()
        doc_ids = torch.repeat_interleave(torch.arange(B, device=cu.device), doc_lens, output_size=num_tokens)
        positions = torch.arange(num_tokens, device=cu.device) - cu[:-1].index_select(0, doc_ids)
        max_seqlen = longest if max_seqlen is None else max_seqlen
        return cls(cu_seqlens.to(torch.int32), max_seqlen, positions, doc_ids, doc_lens)

    @classmethod
    def uniform(cls, batch: int, seqlen: int, device: torch.device) -> Packing:
        """B rows of S tokens, each row one document (no host sync)."""
        cu = torch.arange(0, (batch + 1) * seqlen, seqlen, device=device, dtype=torch.int32)
        positions = torch.arange(seqlen, device=device).repeat(batch)
        doc_ids = torch.arange(batch, device=device).repeat_interleave(seqlen)
        doc_lens = torch.full((batch,), seqlen, device=device, dtype=torch.int64)
        return cls(cu, seqlen, positions, doc_ids, doc_lens)
