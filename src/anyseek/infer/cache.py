"""The paged latent KV cache of absorbed MLA decoding.

Per token and attention layer the cache holds exactly what MLA needs (DeepSeek-V3's "absorb" mode): the normalized
kv_a latent (L = kv_lora_rank values) then the rotated k_pe (R values), in the model's dtype, nothing per head.
Memory is a pool of pages of `page` tokens (64, as FlashMLA); a sequence owns a list of pages (its block table),
grown as it gets longer and returned to the pool when it finishes, so sequences of any lengths share the pool.

    kv [layers, pages, page, L + R]      page 0 is a scratch page: padded rows of a batch write and read there

Bookkeeping (the free list, the tables, the lengths) lives on the host: the host always knows each sequence's
length, so building a step's block table, slots and lengths never waits for the GPU.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

PAGE = 64


class CacheFull(RuntimeError):
    """The pool has no free page left."""


@dataclass
class SeqPages:
    pages: list[int] = field(default_factory=list)
    length: int = 0  # tokens written so far


class PagedLatentCache:
    def __init__(self, n_layers: int, num_pages: int, kv_lora_rank: int, rope_dim: int, dtype: torch.dtype,
                 device: torch.device | str, page: int = PAGE):  # fmt: skip
        if num_pages < 2:
            raise ValueError(f"num_pages must be >= 2 (page 0 is scratch), got {num_pages}")
        self.page, self.kv_lora_rank, self.rope_dim = page, kv_lora_rank, rope_dim
        self.kv = torch.zeros(n_layers, num_pages, page, kv_lora_rank + rope_dim, dtype=dtype, device=device)
        self._free = list(range(num_pages - 1, 0, -1))  # pop() hands out low pages first
        self.seqs: dict[int, SeqPages] = {}

    @property
    def num_free_pages(self) -> int:
        return len(self._free)

    def bytes_per_token(self) -> int:
        """Cache bytes per token over all layers: (L + R) values per layer, nothing else."""
        return self.kv.shape[0] * self.kv.shape[-1] * self.kv.element_size()

    def pages_for(self, n_tokens: int) -> int:
        return -(-n_tokens // self.page)

    # ---- per request ------------------------------------------------------------------------------------------
    def add(self, seq_id: int) -> None:
        if seq_id in self.seqs:
            raise ValueError(f"sequence {seq_id} already has pages")
        self.seqs[seq_id] = SeqPages()

    def reserve(self, seq_id: int, n_tokens: int) -> None:
        """Make room for `n_tokens` tokens in total for `seq_id` (taking pages from the pool)."""
        seq = self.seqs[seq_id]
        need = self.pages_for(n_tokens) - len(seq.pages)
        if need > len(self._free):
            raise CacheFull(f"the latent cache needs {need} more pages of {self.page} tokens, {len(self._free)} free")
        for _ in range(need):
            seq.pages.append(self._free.pop())

    def free(self, seq_id: int) -> None:
        """Return `seq_id`'s pages to the pool."""
        seq = self.seqs.pop(seq_id)
        self._free.extend(reversed(seq.pages))

    # ---- addressing -------------------------------------------------------------------------------------------
    def slots(self, seq_id: int, start: int, stop: int) -> list[int]:
        """Flat row (page * page_size + offset) of positions start..stop-1 of `seq_id` (pages must be reserved)."""
        pages, P = self.seqs[seq_id].pages, self.page
        return [pages[i // P] * P + i % P for i in range(start, stop)]

    def table_row(self, seq_id: int, width: int) -> list[int]:
        pages = self.seqs[seq_id].pages
        if len(pages) > width:
            raise ValueError(f"sequence {seq_id} holds {len(pages)} pages, more than the table width {width}")
        return pages + [0] * (width - len(pages))

    def layer(self, i: int) -> torch.Tensor:
        """The cache of attention layer i: [pages, page, L + R]."""
        return self.kv[i]

    def flat(self, i: int) -> torch.Tensor:
        """The cache of attention layer i as rows: [pages * page, L + R] (a view)."""
        return self.kv[i].view(-1, self.kv.shape[-1])

    def write(self, i: int, slots_T: torch.Tensor, latent_TL: torch.Tensor, k_pe_TR: torch.Tensor) -> None:
        """Store the normalized latents and rotated k_pe of T tokens at flat rows `slots_T` of layer i."""
        flat = self.flat(i)
        flat.index_copy_(0, slots_T, torch.cat([latent_TL, k_pe_TR], dim=-1).to(flat.dtype))
