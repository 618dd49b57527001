"""Generation: `generate(model, prompts, ...)`, continuous batching over the paged latent cache.

    waiting prompts --admit (up to max_batch running)--> prefill --> sample --+--> decode step --> sample --+--> ...
                                                                              `-- finished: pages freed, next admitted

With `speculative="mtp"` each step verifies the MTP module's draft: the main model runs [pending token, draft]
per sequence; when the token it samples equals the draft, the sample after the draft is valid too (two tokens for
one step). Tokens are always drawn from the main model, so the output is exactly that of plain decoding (greedy:
token for token) and the acceptance rate only changes the speed.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from anyseek.data.tokenizer import KNOWN_EOS
from anyseek.infer.engine import Engine
from anyseek.infer.sampling import Sampler, SamplingParams


class GenerationError(ValueError):
    """A request that cannot be served (empty or too-long prompt, unknown token ids, no tokenizer for text)."""


@dataclass
class Request:
    prompt: list[int]
    max_new_tokens: int
    tokens: list[int] = field(default_factory=list)
    finish_reason: str | None = None  # "eos", "stop", "length"
    draft: int | None = None
    slot: int = -1


@dataclass
class Stats:
    prompt_tokens: int = 0
    new_tokens: int = 0
    seconds: float = 0.0
    prefill_seconds: float = 0.0
    steps: int = 0  # decode steps (a speculative step may yield two tokens per sequence)
    drafted: int = 0
    accepted: int = 0

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / self.seconds if self.seconds else 0.0

    @property
    def acceptance_rate(self) -> float | None:
        return self.accepted / self.drafted if self.drafted else None


class Generator:
    """Serves lists of token-id prompts with one model; reusable (its engine and CUDA graphs are kept)."""

    def __init__(self, model, max_batch: int = 32, max_len: int | None = None, cuda_graphs: bool = True,
                 speculative: str | None = None):  # fmt: skip
        if speculative not in (None, "mtp"):
            raise GenerationError(f"speculative must be None or 'mtp', got {speculative!r}")
        if speculative == "mtp" and not len(model.mtp):
            raise GenerationError("speculative='mtp' needs a model with MTP modules (num_nextn_predict_layers >= 1)")
        self.model, self.speculative = model, speculative
        self.context = model.config.max_position_embeddings
        self.max_batch, self.max_len = max_batch, min(max_len or self.context, self.context) + 2
        self.engine = Engine(model, max_batch, self.max_len, cuda_graphs=cuda_graphs)

    def check(self, prompt: Sequence[int]) -> list[int]:
        prompt = [int(t) for t in prompt]
        V = self.model.config.vocab_size
        if not prompt:
            raise GenerationError("empty prompt: give at least one token")
        if len(prompt) >= self.max_len - 2:
            raise GenerationError(f"prompt of {len(prompt)} tokens does not fit the context of {self.max_len - 2} "
                                  f"tokens (max_position_embeddings {self.context})")  # fmt: skip
        if min(prompt) < 0 or max(prompt) >= V:
            raise GenerationError(f"prompt token ids must be in [0, {V}), got {min(prompt)}..{max(prompt)}")
        return prompt

    @torch.no_grad()
    def run(self, prompts: Sequence[Sequence[int]], max_new_tokens: int, sampling: SamplingParams,
            eos_token_id: int | Sequence[int] | None = None, stop: Callable[[int, list[int]], bool] | None = None,
            on_token: Callable[[int, int], None] | None = None) -> tuple[list[Request], Stats]:  # fmt: skip
        """Generate for every prompt. stop(i, tokens) -> True ends request i (stop strings); on_token(i, id) is
        called for each new token as soon as it is known. Returns the requests (new tokens, finish reason)."""
        reqs = [Request(self.check(p), max_new_tokens) for p in prompts]
        eos = {eos_token_id} if isinstance(eos_token_id, int) else set(eos_token_id or ())
        self._eos, self._stop, self._on_token = eos, stop, on_token
        V = self.model.config.vocab_size
        self.sampler = Sampler(sampling, V, self.max_batch, self.engine.device)
        stats = Stats(prompt_tokens=sum(len(r.prompt) for r in reqs))
        waiting, running, free_slots = deque(range(len(reqs))), [], list(range(self.max_batch - 1, -1, -1))
        start = time.perf_counter()
        while waiting or running:
            admit = [waiting.popleft() for _ in range(min(len(waiting), self.max_batch - len(running)))]
            if admit:
                t0 = time.perf_counter()
                for i in admit:
                    reqs[i].slot = free_slots.pop()
                    self.sampler.reset(reqs[i].slot, reqs[i].prompt)
                self._prefill(reqs, admit)
                stats.prefill_seconds += time.perf_counter() - t0
                running += admit
            running = self._retire(reqs, running, free_slots)
            if not running:
                continue
            stats.steps += 1
            if self.speculative:
                self._spec_step(reqs, running, stats)
            else:
                self._step(reqs, running)
            running = self._retire(reqs, running, free_slots)
        stats.seconds = time.perf_counter() - start
        stats.new_tokens = sum(len(r.tokens) for r in reqs)
        return reqs, stats

    # ---- steps ------------------------------------------------------------------------------------------------
    def _prefill(self, reqs: list[Request], admit: list[int]) -> None:
        prompts = [reqs[i].prompt for i in admit]
        logits_BV, h_TD, step = self.engine.prefill(admit, prompts)
        first = self.sampler(logits_BV, [reqs[i].slot for i in admit], self._keys(reqs, admit)).tolist()  # host sync
        for i, t in zip(admit, first):
            self._accept(reqs, i, t)
        if self.speculative:
            drafts = self.engine.mtp_prefill(h_TD, step, prompts, first).argmax(dim=-1).tolist()
            for i, d in zip(admit, drafts):
                reqs[i].draft = d

    def _step(self, reqs: list[Request], running: list[int]) -> None:
        logits_BV = self.engine.decode(running, [reqs[i].tokens[-1] for i in running])
        ids = self.sampler(logits_BV, [reqs[i].slot for i in running], self._keys(reqs, running)).tolist()  # host sync
        for i, t in zip(running, ids):
            self._accept(reqs, i, t)

    def _spec_step(self, reqs: list[Request], running: list[int], stats: Stats) -> None:
        eng = self.engine
        starts = [eng.cache.seqs[i].length for i in running]
        logits_TV, h_TD = eng.extend(running, [[reqs[i].tokens[-1], reqs[i].draft] for i in running])
        first = self.sampler(logits_TV[0::2], [reqs[i].slot for i in running], self._keys(reqs, running)).tolist()
        hit = [t == reqs[i].draft for i, t in zip(running, first)]
        stats.drafted += len(running)
        stats.accepted += sum(hit)
        for i, t in zip(running, first):
            self._accept(reqs, i, t)
        second = {}
        keep = [b for b, i in enumerate(running) if hit[b] and reqs[i].finish_reason is None]
        if keep:
            rows = torch.tensor([2 * b + 1 for b in keep], device=logits_TV.device)
            sel = [running[b] for b in keep]
            ids = self.sampler(
                logits_TV.index_select(0, rows), [reqs[i].slot for i in sel], self._keys(reqs, sel)
            ).tolist()
            second = dict(zip(keep, ids))
            for b, t in second.items():
                self._accept(reqs, running[b], t)
        seqs, mtp_starts, rows, nxt = [], [], [], []
        for b, i in enumerate(running):
            n = 2 if b in second else 1
            eng.rollback(i, starts[b] + n)  # a rejected draft's cache row is overwritten later
            if reqs[i].finish_reason is None:
                seqs.append(i)
                mtp_starts.append(starts[b])
                rows += [2 * b, 2 * b + 1][:n]
                nxt.append([first[b], second[b]] if n == 2 else [first[b]])
        if seqs:
            h_sel = h_TD.index_select(0, torch.tensor(rows, device=h_TD.device))
            drafts = eng.mtp_extend(seqs, mtp_starts, h_sel, nxt).argmax(dim=-1).tolist()
            for i, d in zip(seqs, drafts):
                reqs[i].draft = d

    @staticmethod
    def _keys(reqs: list[Request], idx: list[int]) -> list[tuple[int, int]]:
        """(request number, index of the token about to be drawn): the sampler's noise depends on these only."""
        return [(i, len(reqs[i].tokens)) for i in idx]

    def _accept(self, reqs: list[Request], i: int, token: int) -> None:
        r = reqs[i]
        if r.finish_reason is not None:
            return
        if token in self._eos:
            r.finish_reason = "eos"
            return
        r.tokens.append(token)
        if self._on_token is not None:
            self._on_token(i, token)
        if self._stop is not None and self._stop(i, r.tokens):
            r.finish_reason = "stop"
        elif len(r.tokens) >= r.max_new_tokens or len(r.prompt) + len(r.tokens) >= self.max_len - 2:
            r.finish_reason = "length"

    def _retire(self, reqs: list[Request], running: list[int], free_slots: list[int]) -> list[int]:
        still = []
        for i in running:
            if reqs[i].finish_reason is None:
                still.append(i)
            else:
                self.engine.free(i)
                free_slots.append(reqs[i].slot)
        return still


def _encode(tokenizer, text: str) -> list[int]:
    enc = tokenizer.encode(text)
    return list(enc.ids) if hasattr(enc, "ids") else list(enc)


def _stop_strings(tokenizer, stop: Sequence[str]) -> Callable[[int, list[int]], bool]:
    longest = max(len(s) for s in stop)

    def hit(i: int, tokens: list[int]) -> bool:
        tail = tokenizer.decode(tokens[-(longest + 8) :])  # a token is at least one character (or part of one)
        return any(s in tail for s in stop)

    return hit


def cut_at_stop(text: str, stop: Sequence[str] | None) -> str:
    """`text` up to (not including) the first stop string."""
    cut = min((text.find(s) for s in stop or () if s in text), default=-1)
    return text if cut < 0 else text[:cut]


def generate(
    model,
    prompts,
    max_new_tokens: int = 40,
    temperature: float = 0.8,
    top_k: int = 40,
    top_p: float = 1.0,
    repetition_penalty: float = 1.0,
    seed: int = 0,
    eos_token_id: int | Sequence[int] | None = None,
    stop: Sequence[str] | None = None,
    tokenizer=None,
    speculative: str | None = None,
    max_batch: int = 32,
    cuda_graphs: bool = True,
    return_stats: bool = False,
):
    """Continue each prompt by up to `max_new_tokens` tokens with a latent-cached, batched decoder.

    prompts: a list of token-id lists, or strings (then `tokenizer`, a `tokenizers.Tokenizer` or a transformers
    tokenizer, is required), or one prompt of either kind. Returns the new tokens only: token-id lists, or strings
    for string prompts (cut before any `stop` string); the same nesting as `prompts`. temperature 0 is greedy.
    eos_token_id ends a sequence (not included); by default the tokenizer's eos when it has one.
    speculative="mtp" drafts with the model's MTP module (same output, fewer steps). return_stats adds a `Stats`.
    """
    single = isinstance(prompts, str) or (len(prompts) > 0 and isinstance(prompts[0], int))
    batch = [prompts] if single else list(prompts)
    texts = bool(batch) and isinstance(batch[0], str)
    if (texts or stop) and tokenizer is None:
        raise GenerationError("text prompts and stop strings need a tokenizer (tokenizer=...)")
    ids = [_encode(tokenizer, p) if isinstance(p, str) else list(p) for p in batch]
    if eos_token_id is None and tokenizer is not None:
        eos_token_id = _tokenizer_eos(tokenizer)
    was_training = model.training
    model.eval()
    try:
        graphs = cuda_graphs and not torch.is_autocast_enabled("cuda")
        longest = max((len(p) for p in ids), default=1)
        gen = Generator(model, max_batch=max(1, min(max_batch, len(ids))), max_len=longest + max_new_tokens + 1,
                        cuda_graphs=graphs, speculative=speculative)  # fmt: skip
        params = SamplingParams(temperature, top_k, top_p, repetition_penalty, seed)
        stop_fn = _stop_strings(tokenizer, stop) if stop else None
        reqs, stats = gen.run(ids, max_new_tokens, params, eos_token_id, stop_fn)
    finally:
        model.train(was_training)
    outs = [r.tokens for r in reqs]
    if texts:
        outs = [cut_at_stop(tokenizer.decode(t), stop) for t in outs]
    result = outs[0] if single else outs
    return (result, stats) if return_stats else result


def _tokenizer_eos(tokenizer) -> int | None:
    eos = getattr(tokenizer, "eos_token_id", None)
    if eos is not None:
        return eos
    if hasattr(tokenizer, "token_to_id"):  # tokenizers.Tokenizer: try the usual names

        return next((tokenizer.token_to_id(t) for t in KNOWN_EOS if tokenizer.token_to_id(t) is not None), None)
    return None
