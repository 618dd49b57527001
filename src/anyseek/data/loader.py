"""PackedLoader: prepared token shards -> packed varlen micro-batches for the model.

Each rank reads its share of the documents (a stride of the epoch's order) as one stream of tokens and cuts it
into windows of exactly `tokens_per_batch` tokens (the final window of a loop=False pass may be shorter): no
padding. See pieces.py for how windows become segments and targets.

Order: loop=True shuffles the documents each epoch with a generator seeded by (seed, epoch), so every run and every
resume sees the same order; loop=False reads the documents in their stored order once (validation).
State is (epoch, position in this rank's stream): `load_state_dict` resumes at exactly the next token, even with a
different tokens_per_batch or max_seqlen.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from anyseek.data.pieces import Pieces, assemble, window
from anyseek.data.shards import open_split, read_manifest

STATE_VERSION = 1


@dataclass
class Batch:
    """A packed micro-batch of N tokens in B segments.

    input_ids int64 [N]; targets int64 [N] (next token of the same document, -100 where there is none);
    cu_seqlens int32 [B+1] (segment starts, 0 first, N last); max_seqlen: the longest segment.
    """

    input_ids: torch.Tensor
    targets: torch.Tensor
    cu_seqlens: torch.Tensor
    max_seqlen: int

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.numel())

    @property
    def num_segments(self) -> int:
        return int(self.cu_seqlens.numel()) - 1

    def to(self, device, non_blocking: bool = False) -> Batch:
        ids, tgt, cu = (
            t.to(device, non_blocking=non_blocking) for t in (self.input_ids, self.targets, self.cu_seqlens)
        )
        return Batch(ids, tgt, cu, self.max_seqlen)

    def pin_memory(self) -> Batch:
        return Batch(self.input_ids.pin_memory(), self.targets.pin_memory(), self.cu_seqlens.pin_memory(),
                     self.max_seqlen)  # fmt: skip


class PackedLoader:
    """Iterate packed micro-batches of `tokens_per_batch` tokens from DATA_DIR's `split`."""

    def __init__(
        self,
        data_dir: str | Path,
        split: str = "train",
        tokens_per_batch: int = 16384,
        max_seqlen: int = 2048,
        seed: int = 0,
        rank: int = 0,
        world_size: int = 1,
        loop: bool = True,
        shuffle: bool | None = None,
    ):
        if tokens_per_batch < 1 or max_seqlen < 1:
            raise ValueError(f"tokens_per_batch and max_seqlen must be >= 1, got {tokens_per_batch}, {max_seqlen}")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank must be in [0, world_size), got rank={rank}, world_size={world_size}")
        self.data_dir = Path(data_dir)
        self.manifest = read_manifest(self.data_dir)
        self.data = open_split(self.data_dir, split, self.manifest)
        if self.data.num_docs < world_size:
            raise ValueError(
                f"{self.data_dir}: split {split!r} has {self.data.num_docs} documents, fewer than world_size="
                f"{world_size}; prepare more data or use a larger val_fraction"
            )
        self.split, self.tokens_per_batch, self.max_seqlen = split, tokens_per_batch, max_seqlen
        self.seed, self.rank, self.world_size, self.loop = seed, rank, world_size, loop
        self.shuffle = loop if shuffle is None else shuffle
        self.epoch, self.position = 0, 0
        self._cached_epoch: int | None = None

    # ------------------------------------------------------------------------------------------ order
    def _epoch_stream(self, epoch: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """This rank's documents for `epoch` and where each starts and ends in its token stream."""
        if self._cached_epoch != epoch:
            n = self.data.num_docs
            order = np.random.default_rng([self.seed, epoch]).permutation(n) if self.shuffle else np.arange(n)
            order = order[self.rank :: self.world_size]
            ends = np.cumsum(self.data.doc_len[order])
            self._cache = (order, ends - self.data.doc_len[order], ends)
            self._cached_epoch = epoch
        return self._cache

    @property
    def tokens_per_epoch(self) -> int:
        """Tokens in this rank's share of one epoch."""
        return int(self._epoch_stream(self.epoch)[2][-1])

    def __bool__(self) -> bool:  # `if loader:` must not call __len__ on an infinite loader
        return True

    def __len__(self) -> int:
        """Batches in one pass (loop=False only; a looping loader is infinite)."""
        if self.loop:
            raise TypeError("a PackedLoader with loop=True is infinite")
        return (self.tokens_per_epoch + self.tokens_per_batch - 1) // self.tokens_per_batch

    def len_per_rank(self) -> list[int]:
        """Batches in one pass for every rank (loop=False). Ranks get different numbers of tokens, so a distributed
        evaluation that runs a collective per batch must run max(len_per_rank()) steps on every rank."""
        if self.loop:
            raise TypeError("a PackedLoader with loop=True is infinite")
        n = self.data.num_docs
        order = np.random.default_rng([self.seed, 0]).permutation(n) if self.shuffle else np.arange(n)
        tokens = [int(self.data.doc_len[order[r :: self.world_size]].sum()) for r in range(self.world_size)]
        return [(t + self.tokens_per_batch - 1) // self.tokens_per_batch for t in tokens]

    # ------------------------------------------------------------------------------------------ batches
    def _next_batch(self) -> Batch | None:
        parts, want = [], self.tokens_per_batch
        epoch, pos = self.epoch, self.position
        while want > 0:
            order, starts, ends = self._epoch_stream(epoch)
            total = int(ends[-1])
            if pos >= total:
                if not self.loop:
                    break
                epoch, pos = epoch + 1, 0
                continue
            n = min(want, total - pos)
            parts.append(window(order, starts, ends, pos, n))
            pos, want = pos + n, want - n
        if not parts:
            return None
        self.epoch, self.position = epoch, pos
        pieces = parts[0] if len(parts) == 1 else _concat_pieces(parts)
        input_ids, targets, cu, longest = assemble(self.data, pieces, self.max_seqlen)
        return Batch(torch.from_numpy(input_ids), torch.from_numpy(targets), torch.from_numpy(cu), longest)

    def __iter__(self) -> Iterator[Batch]:
        while True:
            batch = self._next_batch()
            if batch is None:  # end of a loop=False pass: the next iteration starts a new pass
                self.epoch, self.position = 0, 0
                return
            yield batch

    # ------------------------------------------------------------------------------------------ state
    def _identity(self) -> dict:
        return {
            "split": self.split,
            "seed": self.seed,
            "rank": self.rank,
            "world_size": self.world_size,
            "shuffle": self.shuffle,
            "documents": self.data.num_docs,
            "tokens": int(self.data.doc_len.sum()),
            "tokenizer_sha256": self.manifest.get("tokenizer_sha256"),  # same data, even if prepared elsewhere
        }

    def state_dict(self) -> dict:
        """JSON-able: where the next batch starts."""
        return {"version": STATE_VERSION, "epoch": self.epoch, "position": self.position, **self._identity()}

    def load_state_dict(self, state: dict) -> None:
        if state.get("version") != STATE_VERSION:
            raise ValueError(f"loader state version {state.get('version')!r}, expected {STATE_VERSION}")
        for key, value in self._identity().items():
            if state.get(key) != value:
                raise ValueError(f"loader state key {key!r} is {state.get(key)!r} but this loader has {value!r}")
        self.epoch, self.position = int(state["epoch"]), int(state["position"])


def _concat_pieces(parts):

    return Pieces(*(np.concatenate([getattr(p, f) for p in parts]) for f in ("doc_P", "start_P", "stop_P")))
