"""What every layer needs to know about a packed batch, computed once per forward and never changed after.

Shape legend: T tokens, B documents (segments), R rope dim.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class PackedLayout:
    """A packed batch of B documents: cu_seqlens int32 [B+1] (validated: starts at 0, never decreases, ends at T),
    max_seqlen (host int), positions [T] (restart at 0 in every document), doc_ids [T] (document of each token),
    doc_lens int64 [B], and the rotary tables cos/sin fp32 [T, R/2] for those positions (None until `with_rope`)."""

    cu_seqlens: torch.Tensor
    max_seqlen: int
    positions: torch.Tensor
    doc_ids: torch.Tensor
    doc_lens: torch.Tensor
    cos: torch.Tensor | None = None
    sin: torch.Tensor | None = None

    @property
    def num_tokens(self) -> int:
        return self.positions.shape[0]

    @classmethod
    def build(cls, cu_seqlens: torch.Tensor, num_tokens: int, max_seqlen: int | None = None) -> PackedLayout:
        """From document starts. One host sync (checks cu_seqlens, finds max_seqlen); no per-token Python.
        This is the one place cu_seqlens' values are checked: the kernel seams check only its shape and dtype.
        max_seqlen, where given, is an upper bound of the document lengths."""
        if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
            raise ValueError(f"cu_seqlens must be 1-D with at least 2 entries, got shape {tuple(cu_seqlens.shape)}")
        cu = cu_seqlens.to(torch.int64)
        doc_lens = cu[1:] - cu[:-1]
        # a CUDA graph being recorded cannot read values: its runner checks each batch on the host (train/graphs.py)
        if max_seqlen is None or not _capturing(cu):
            first, last, shortest, longest = torch.stack([cu[0], cu[-1], doc_lens.min(), doc_lens.max()]).tolist()
            check_cu_seqlens(first, last, shortest, num_tokens)
            max_seqlen = longest if max_seqlen is None else max_seqlen
        B = doc_lens.numel()
        doc_ids = torch.repeat_interleave(torch.arange(B, device=cu.device), doc_lens, output_size=num_tokens)
        positions = torch.arange(num_tokens, device=cu.device) - cu[:-1].index_select(0, doc_ids)
        # a tensor of this layout's own (a copy where cu_seqlens is int32 already): the attention kernels cache their
        # tile schedules by it for every layer of one forward and backward, which is only right while nothing
        # rewrites it in place (as a CUDA graph's input buffer is rewritten before each replay)
        return cls(cu_seqlens.to(torch.int32, copy=True), max_seqlen, positions, doc_ids, doc_lens)

    @classmethod
    def uniform(cls, batch: int, seqlen: int, device: torch.device) -> PackedLayout:
        """B rows of S tokens, each row one document (no host sync)."""
        cu = torch.arange(0, (batch + 1) * seqlen, seqlen, device=device, dtype=torch.int32)
        positions = torch.arange(seqlen, device=device).repeat(batch)
        doc_ids = torch.arange(batch, device=device).repeat_interleave(seqlen)
        doc_lens = torch.full((batch,), seqlen, device=device, dtype=torch.int64)
        return cls(cu, seqlen, positions, doc_ids, doc_lens)

    def with_rope(self, cos: torch.Tensor, sin: torch.Tensor) -> PackedLayout:
        """The same layout with its rotary tables."""
        return dataclasses.replace(self, cos=cos, sin=sin)


def check_cu_seqlens(first: int, last: int, shortest: int, num_tokens: int) -> None:
    """cu_seqlens' values, from its first and last entry and its shortest document: start at 0, never decrease, end
    at the token count."""
    if first != 0 or last != num_tokens or shortest < 0:
        raise ValueError(
            f"cu_seqlens must start at 0, never decrease and end at the token count {num_tokens}; "
            f"got {first}..{last}{' with a decreasing step' if shortest < 0 else ''}"
        )


def _capturing(t: torch.Tensor) -> bool:
    return t.device.type == "cuda" and torch.cuda.is_current_stream_capturing()
