"""Choosing the next token from logits, on the device, without waiting for it.

Order (as transformers applies them): repetition penalty, temperature, top-k, top-p, then a draw; temperature 0 is
greedy (argmax, after the penalty). The draw is Gumbel-max with noise from a counter-based hash of (seed, request,
token index, vocabulary id): a request's tokens depend on its prompt and the seed only, never on which other
requests share its batch, the batch order, or whether speculative decoding ran. Shape legend: B rows, V vocab.

Each slot (a running sequence) has its own `SamplingParams` (the server's requests differ). The rows of a batch are
drawn in groups of equal knobs (temperature, top-k, top-p, penalty): each group runs the same ops as a batch of
only those rows, and every op is row-wise, so a row's draw is the one it gets in any other batch; the seed enters
only through the row's noise key.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from anyseek import kernels


@dataclass
class SamplingParams:
    temperature: float = 0.8  # 0: greedy
    top_k: int = 40  # 0: off
    top_p: float = 1.0  # 1: off
    repetition_penalty: float = 1.0  # 1: off; > 1 discourages tokens already in the prompt or the output
    seed: int = 0

    def __post_init__(self):
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def knobs(self) -> tuple:
        """What the ops depend on (not the seed, which only enters the noise keys): rows with equal knobs share ops."""
        return self.temperature, self.top_k, self.top_p, self.repetition_penalty


class Sampler:
    """Draws ids for rows of logits. Each of `slots` slots has its parameters (`params` until `reset` gives it
    others); `seen` rows remember each running sequence's tokens (only once some slot has a repetition penalty)."""

    def __init__(self, params: SamplingParams, vocab: int, slots: int, device: torch.device):
        self.params, self.vocab, self.device = params, vocab, device
        self.slot_params = [params] * slots
        self.seen = None
        if params.repetition_penalty != 1:
            self._track()

    def _track(self) -> None:
        self.seen = torch.zeros(len(self.slot_params), self.vocab, dtype=torch.bool, device=self.device)

    def reset(self, slot: int, tokens: list[int], params: SamplingParams | None = None) -> None:
        """A new sequence in `slot`: its prompt `tokens` and its parameters (None: the sampler's)."""
        p = self.slot_params[slot] = params or self.params
        if p.repetition_penalty != 1 and self.seen is None:
            self._track()
        if self.seen is not None:
            self.seen[slot] = False
            self.seen[slot, upload_ints(tokens, self.seen.device)] = True

    def mark(self, slots: list[int], ids_B: torch.Tensor) -> None:
        if self.seen is not None:
            self.seen[upload_ints(slots, ids_B.device), ids_B] = True

    def __call__(self, logits_BV: torch.Tensor, slots: list[int], keys: list[tuple[int, int]]) -> torch.Tensor:
        """fp32 logits [B, V] of the sequences in `slots`; keys[b] = (request number, index of the token drawn)
        -> ids int64 [B] (on the device; marked as seen)."""
        logits_BV = logits_BV.float()
        ps = [self.slot_params[s] for s in slots]
        p0 = ps[0]
        if all(p is p0 for p in ps) or all(p.knobs == p0.knobs for p in ps):  # one group (always, in `generate`)
            ids_B = self._group(logits_BV, ps, slots, keys)
        else:
            groups: dict[tuple, list[int]] = {}
            for b, p in enumerate(ps):
                groups.setdefault(p.knobs, []).append(b)
            ids_B = torch.empty(len(slots), dtype=torch.int64, device=logits_BV.device)
            for rows in groups.values():
                idx = upload_ints(rows, logits_BV.device)
                ids_B[idx] = self._group(logits_BV.index_select(0, idx), [ps[b] for b in rows],
                                         [slots[b] for b in rows], [keys[b] for b in rows])  # fmt: skip
        self.mark(slots, ids_B)
        return ids_B

    def _group(self, logits_BV: torch.Tensor, ps: list[SamplingParams], slots: list[int],
               keys: list[tuple[int, int]]) -> torch.Tensor:  # fmt: skip
        """Rows whose parameters share their knobs (ps[b]: row b's, seeds may differ) -> ids [B]."""
        p = ps[0]
        if self.seen is not None and p.repetition_penalty != 1:
            seen_BV = self.seen[upload_ints(slots, logits_BV.device)]
            penalized = torch.where(logits_BV > 0, logits_BV / p.repetition_penalty, logits_BV * p.repetition_penalty)
            logits_BV = torch.where(seen_BV, penalized, logits_BV)
        if p.greedy:
            return logits_BV.argmax(dim=-1)
        return self._draw(logits_BV / p.temperature, p, [(q.seed, r, i) for q, (r, i) in zip(ps, keys)])

    def _draw(self, logits_BV: torch.Tensor, p: SamplingParams, keys: list[tuple[int, int, int]]) -> torch.Tensor:
        if 0 < p.top_k < logits_BV.shape[-1]:
            kth_B1 = torch.topk(logits_BV, p.top_k, dim=-1).values[:, -1:]
            logits_BV = logits_BV.masked_fill(logits_BV < kth_B1, float("-inf"))
        if p.top_p < 1:
            sorted_BV, order_BV = torch.sort(logits_BV, dim=-1, descending=True)
            probs_BV = sorted_BV.softmax(dim=-1)
            drop_BV = probs_BV.cumsum(dim=-1) - probs_BV > p.top_p  # keep the smallest prefix reaching top_p
            drop_BV[:, 0] = False
            logits_BV = logits_BV.scatter(1, order_BV, sorted_BV.masked_fill(drop_BV, float("-inf")))
        row_keys = [_mix(_mix(seed * 0x9E3779B9 + r) + i) for seed, r, i in keys]
        return kernels.gumbel_argmax(logits_BV, upload_ints(row_keys, logits_BV.device))  # a draw from softmax(logits)


def upload_ints(values: list[int], device: torch.device) -> torch.Tensor:
    """Host ints -> int64 on `device` without waiting for the device's queue (pinned memory, an asynchronous copy:
    `Generator`'s lookahead reads nothing back until the step's tokens; the engine's inputs go the same way)."""
    t = torch.tensor(values, dtype=torch.int64)
    return t.pin_memory().to(device, non_blocking=True) if torch.device(device).type == "cuda" else t


_M64 = (1 << 64) - 1


def _mix(x: int) -> int:
    """splitmix64 finalizer on Python ints (host side of the row keys)."""
    x = (x + 0x9E3779B97F4A7C15) & _M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _M64
    x = x ^ (x >> 31)
    return x - (1 << 64) if x >= 1 << 63 else x  # as a signed int64


