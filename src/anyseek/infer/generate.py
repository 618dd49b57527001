"""Generation: `generate(model, prompts, ...)`, continuous batching over the paged latent cache.

    waiting requests --admit (batch slots, cache pages, prefill budget)--> prefill --> sample --+--> decode step --> ...
                                                                                             `-- finished: pages freed

`Generator` is the one scheduler of `generate()` and of `anyseek serve`: `submit` queues a request, `cancel` drops
one (waiting, or running: its pages are freed at the next step), `step` runs one round (admit and prefill what
fits, one decode step for every running sequence, retire the finished); `run` is `submit` for every prompt and
`step` until all are done. A request is admitted only when the pool can hold it at its longest (prompt +
max_new_tokens) beside the worst case of every running one, so a running request never runs out of pages: a full
cache keeps requests waiting, it never evicts one.

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


@dataclass(eq=False)  # a request is itself: `in` and `remove` on the queue compare identities
class Request:
    """One sequence to continue. `id` names it in the engine (unique among live requests); `key` is its request
    number in the sampler's noise (`generate`: its index in the list). params None: the Generator's."""

    prompt: list[int]
    max_new_tokens: int
    id: int = 0
    key: int = 0
    params: SamplingParams | None = None
    eos: frozenset[int] = frozenset()
    stop: Callable[[list[int]], bool] | None = None  # stop(tokens) -> True ends it (stop strings)
    tokens: list[int] = field(default_factory=list)
    finish_reason: str | None = None  # "eos", "stop", "length", "cancelled"
    draft: int | None = None
    slot: int = -1
    queued_at: float = 0.0  # when it was submitted (the Generator's clock)


@dataclass
class Stats:
    prompt_tokens: int = 0
    new_tokens: int = 0
    seconds: float = 0.0
    prefill_seconds: float = 0.0
    steps: int = 0  # decode steps (a speculative step may yield two tokens per sequence)
    decode_seconds: float = 0.0  # in the decode steps, the host's wait for their tokens included
    decode_rows: int = 0  # sequences summed over the decode steps (their mean batch: decode_rows / steps)
    drafted: int = 0
    accepted: int = 0

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / self.seconds if self.seconds else 0.0

    @property
    def acceptance_rate(self) -> float | None:
        return self.accepted / self.drafted if self.drafted else None


class Generator:
    """Serves token-id requests with one model; reusable (its engine and CUDA graphs are kept).

    max_len: the longest sequence (prompt + new tokens; default and at most the model's context). cache_tokens: the
    page pool in tokens (default max_batch * max_len). prefill_tokens: at most this many prompt tokens are prefilled
    in one step (at least one request; None: no limit), so arrivals do not stall the running sequences for long.
    batch_arrivals (a server under load; False: admit at once): while sequences decode, arrivals wait to be
    prefilled together, as long as waiting costs less than a prefill would. A prefill stalls every decoding
    sequence for its duration P (about the same for one prompt as for several where it is launch-bound: a large
    model's eager forward on a GPU), R running sequences losing R * P of decoding; each step the waiting requests
    do not decode costs them that step's time each. They are admitted once what they lost waiting reaches R * P
    (the rent-or-buy rule, at most twice the best choice in hindsight), once the oldest has waited 2 P, when they
    would fill every free slot, or when nothing decodes; P is the last prefill's duration.

    lookahead (default: where decode steps are CUDA graphs, without speculation): each decode step is launched
    before the previous step's sampled tokens are read back, its inputs taking them on the device, so the GPU runs
    it while the host accepts those tokens, streams them and prepares the next step (that host time otherwise
    leaves the GPU idle every step). A sequence that turns out finished (eos, a stop string, a cancel) has had one
    step computed for nothing; one that ends by length is not launched again. The tokens are those of plain
    stepping (each draw's noise is keyed by its request and index, never by its batch)."""

    def __init__(self, model, max_batch: int = 32, max_len: int | None = None, cuda_graphs: bool = True,
                 speculative: str | None = None, cache_tokens: int | None = None,
                 prefill_tokens: int | None = None, batch_arrivals: bool = False,
                 lookahead: bool | None = None):  # fmt: skip
        if speculative not in (None, "mtp"):
            raise GenerationError(f"speculative must be None or 'mtp', got {speculative!r}")
        if speculative == "mtp" and not len(model.mtp):
            raise GenerationError("speculative='mtp' needs a model with MTP modules (num_nextn_predict_layers >= 1)")
        self.model, self.speculative = model, speculative
        self.context = model.config.max_position_embeddings
        self.max_batch, self.max_len = max_batch, min(max_len or self.context, self.context) + 2
        self.prefill_tokens, self.batch_arrivals = prefill_tokens, batch_arrivals
        self.clock = time.perf_counter  # (a test's clock may replace it)
        self._prefill_s = 0.0  # the last prefill's seconds (P)
        self._wait_cost = 0.0  # the decoding the waiting requests lost since the last admission (sequence-seconds)
        self.engine = Engine(model, max_batch, self.max_len, cuda_graphs=cuda_graphs, cache_tokens=cache_tokens)
        if lookahead and speculative:
            raise GenerationError("lookahead decoding does not combine with speculative='mtp'")
        self.lookahead = self.engine.use_graphs and not speculative if lookahead is None else lookahead
        self._pending: tuple[list[Request], torch.Tensor] | None = None  # the step in flight and its sampled ids
        self.sampler = Sampler(SamplingParams(), model.config.vocab_size, max_batch, self.engine.device)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.free_slots = list(range(max_batch - 1, -1, -1))
        self.stats = Stats()
        self._on_token: Callable[[int, int], None] | None = None

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
        if self.waiting or self.running:
            raise GenerationError("this Generator is serving other requests")
        eos = frozenset({eos_token_id} if isinstance(eos_token_id, int) else eos_token_id or ())
        reqs = [Request(self.check(p), max_new_tokens, id=i, key=i, eos=eos, stop=_bind(stop, i))
                for i, p in enumerate(prompts)]  # fmt: skip
        self.sampler = Sampler(sampling, self.model.config.vocab_size, self.max_batch, self.engine.device)
        self._on_token, self.stats = on_token, Stats(prompt_tokens=sum(len(r.prompt) for r in reqs))
        start = time.perf_counter()
        for r in reqs:
            self.submit(r)
        try:
            while self.waiting or self.running:
                self.step()
        finally:
            self._on_token = None
        self.stats.seconds = time.perf_counter() - start
        self.stats.new_tokens = sum(len(r.tokens) for r in reqs)
        return reqs, self.stats

    # ---- the scheduler ----------------------------------------------------------------------------------------
    def submit(self, r: Request) -> None:
        """Queue `r` (its prompt checked with `check`, its max_new_tokens >= 1) behind the waiting ones."""
        if self.pages_needed(r) > self.engine.num_pages:
            raise GenerationError(f"a request of {len(r.prompt)} + {r.max_new_tokens} tokens needs more than the "
                                  f"{self.engine.num_pages * self.engine.cache.page}-token cache")  # fmt: skip
        r.queued_at = self.clock()
        self.waiting.append(r)

    def cancel(self, r: Request) -> None:
        """Drop `r`: a waiting request leaves the queue, a running one frees its slot and pages at the next step."""
        if r.finish_reason is None:
            r.finish_reason = "cancelled"
        if r.slot < 0 and r in self.waiting:
            self.waiting.remove(r)

    def reset(self) -> None:
        """Drop every request (after a failed step, or to stop): all pages and slots back."""
        for r in [*self.running, *self.waiting]:
            r.finish_reason = r.finish_reason or "cancelled"
        for sid in list(self.engine.cache.seqs):
            self.engine.free(sid)
        self.running, self.waiting = [], deque()
        self.free_slots = list(range(self.max_batch - 1, -1, -1))
        self._wait_cost, self._pending = 0.0, None

    def pages_needed(self, r: Request) -> int:
        """Cache pages `r` holds at its longest (its prompt, max_new_tokens, a draft)."""
        return self.engine.pages_needed(len(r.prompt) + r.max_new_tokens + 1)

    @torch.no_grad()
    def step(self, on_prefill: Callable[[list[Request]], None] | None = None) -> list[Request]:
        """One round: admit what fits (prefill), one decode step for the running sequences, retire the finished
        (their pages freed). Returns the requests that got tokens or finished in it. on_prefill(admitted) is called
        between the prefill and the decode step (a server hands out first tokens there)."""
        self._retire()  # cancelled since the last step
        admit = self._admit() if self._due() else []
        if admit:
            t0 = self.clock()
            for r in admit:
                r.slot = self.free_slots.pop()
                self.sampler.reset(r.slot, r.prompt, r.params)
            self._prefill(admit)
            end = self.clock()
            self._prefill_s, self._wait_cost = end - t0, 0.0
            self.stats.prefill_seconds += end - t0
            self.running += admit
            if on_prefill is not None:
                on_prefill(admit)
        self._retire()  # finished at their first token
        if self.lookahead:
            stepped = self._step_ahead()
        elif self.running:
            stepped = list(self.running)
            t0 = self.clock()
            (self._spec_step if self.speculative else self._step)(stepped)
            self._spent(len(stepped), self.clock() - t0)
            self._retire()
        else:
            stepped = []
        return stepped if not admit else list({id(r): r for r in admit + stepped}.values())

    def _spent(self, rows: int, took: float) -> None:
        """A decode step's accounting: its rows (0: nothing was launched), its seconds, and the decoding lost by
        the waiting requests that had a free slot (`batch_arrivals`)."""
        self.stats.steps += rows > 0
        self.stats.decode_rows += rows
        self.stats.decode_seconds += took
        if self.waiting:
            self._wait_cost += min(len(self.waiting), self.max_batch - rows) * took

    def _due(self) -> bool:
        """Whether waiting requests may be admitted in this step (`batch_arrivals`)."""
        if not self.batch_arrivals or not self.running or not self.waiting:
            return True
        if len(self.waiting) >= self.max_batch - len(self.running):  # they would fill every free slot
            return True
        P = self._prefill_s
        return self._wait_cost >= len(self.running) * P or self.clock() - self.waiting[0].queued_at >= 2 * P

    def _admit(self) -> list[Request]:
        """The waiting requests (in order) that fit: a batch slot, the pages of their longest length beside every
        running request's, and the prefill budget (the first always, if slot and pages allow)."""
        if not self.waiting or len(self.running) >= self.max_batch:
            return []
        held = {r.id: len(self.engine.cache.seqs[r.id].pages) for r in self.running}
        spare = self.engine.cache.num_free_pages - sum(self.pages_needed(r) - held[r.id] for r in self.running)
        budget, admit = self.prefill_tokens, []
        while self.waiting and len(self.running) + len(admit) < self.max_batch:
            r = self.waiting[0]
            need = self.pages_needed(r)
            if need > spare or (admit and budget is not None and len(r.prompt) > budget):
                break
            spare -= need
            budget = None if budget is None else budget - len(r.prompt)
            admit.append(self.waiting.popleft())
        return admit

    # ---- steps ------------------------------------------------------------------------------------------------
    def _prefill(self, admit: list[Request]) -> None:
        prompts = [r.prompt for r in admit]
        logits_BV, h_TD, step = self.engine.prefill([r.id for r in admit], prompts)
        first = self.sampler(logits_BV, [r.slot for r in admit], self._keys(admit)).tolist()  # host sync
        for r, t in zip(admit, first):
            self._accept(r, t)
        if self.speculative:
            drafts = self.engine.mtp_prefill(h_TD, step, prompts, first).argmax(dim=-1).tolist()
            for r, d in zip(admit, drafts):
                r.draft = d

    def _step(self, running: list[Request]) -> None:
        logits_BV = self.engine.decode([r.id for r in running], [r.tokens[-1] for r in running])
        ids = self.sampler(logits_BV, [r.slot for r in running], self._keys(running)).tolist()  # host sync
        for r, t in zip(running, ids):
            self._accept(r, t)

    def _step_ahead(self) -> list[Request]:
        """A decode step for the running sequences launched before the previous step's tokens are read back
        (`lookahead`); then those tokens accepted while the GPU runs it. -> the requests of the previous step."""
        prev = self._pending
        rows = {id(r): j for j, r in enumerate(prev[0])} if prev is not None else {}
        launch = [r for r in self.running if not self._ends_by_length(r, id(r) in rows)]
        t0 = self.clock()
        self._pending = None
        if launch:
            src = [rows.get(id(r), -1) for r in launch]  # its token: the previous step's row j, or its last one
            last = [r.tokens[-1] if j < 0 else 0 for r, j in zip(launch, src)]
            logits_BV = self.engine.decode([r.id for r in launch], last, None if prev is None else (prev[1], src))
            keys = [(r.key, len(r.tokens) + (j >= 0)) for r, j in zip(launch, src)]
            self._pending = (launch, self.sampler(logits_BV, [r.slot for r in launch], keys))
        if prev is not None:
            for r, t in zip(prev[0], prev[1].tolist()):  # host sync: the GPU has the next step already
                self._accept(r, t)
        self._spent(len(launch), self.clock() - t0)
        self._retire()
        if not self.running:  # (a step launched for sequences that all turned out finished: nothing to read)
            self._pending = None
        return prev[0] if prev is not None else []

    def _ends_by_length(self, r: Request, pending: bool) -> bool:
        """Whether `r` is done once its pending token (if any) is accepted, whatever that token: its length limit."""
        n = len(r.tokens) + pending
        return r.finish_reason is not None or n >= r.max_new_tokens or len(r.prompt) + n >= self.max_len - 2

    def _spec_step(self, running: list[Request]) -> None:
        eng, stats = self.engine, self.stats
        starts = [eng.cache.seqs[r.id].length for r in running]
        logits_TV, h_TD = eng.extend([r.id for r in running], [[r.tokens[-1], r.draft] for r in running])
        first = self.sampler(logits_TV[0::2], [r.slot for r in running], self._keys(running)).tolist()
        hit = [t == r.draft for r, t in zip(running, first)]
        stats.drafted += len(running)
        stats.accepted += sum(hit)
        for r, t in zip(running, first):
            self._accept(r, t)
        second = {}
        keep = [b for b, r in enumerate(running) if hit[b] and r.finish_reason is None]
        if keep:
            rows = torch.tensor([2 * b + 1 for b in keep], device=logits_TV.device)
            sel = [running[b] for b in keep]
            ids = self.sampler(logits_TV.index_select(0, rows), [r.slot for r in sel], self._keys(sel)).tolist()
            second = dict(zip(keep, ids))
            for b, t in second.items():
                self._accept(running[b], t)
        seqs, mtp_starts, rows, nxt = [], [], [], []
        for b, r in enumerate(running):
            n = 2 if b in second else 1
            eng.rollback(r.id, starts[b] + n)  # a rejected draft's cache row is overwritten later
            if r.finish_reason is None:
                seqs.append(r)
                mtp_starts.append(starts[b])
                rows += [2 * b, 2 * b + 1][:n]
                nxt.append([first[b], second[b]] if n == 2 else [first[b]])
        if seqs:
            h_sel = h_TD.index_select(0, torch.tensor(rows, device=h_TD.device))
            drafts = eng.mtp_extend([r.id for r in seqs], mtp_starts, h_sel, nxt).argmax(dim=-1).tolist()
            for r, d in zip(seqs, drafts):
                r.draft = d

    @staticmethod
    def _keys(reqs: list[Request]) -> list[tuple[int, int]]:
        """(request number, index of the token about to be drawn): the sampler's noise depends on these only."""
        return [(r.key, len(r.tokens)) for r in reqs]

    def _accept(self, r: Request, token: int) -> None:
        if r.finish_reason is not None:
            return
        if token in r.eos:
            r.finish_reason = "eos"
            return
        r.tokens.append(token)
        if self._on_token is not None:
            self._on_token(r.key, token)
        if r.stop is not None and r.stop(r.tokens):
            r.finish_reason = "stop"
        elif len(r.tokens) >= r.max_new_tokens or len(r.prompt) + len(r.tokens) >= self.max_len - 2:
            r.finish_reason = "length"

    def _retire(self) -> list[Request]:
        """Move the finished running requests out (pages and slot freed) -> those."""
        done = [r for r in self.running if r.finish_reason is not None]
        if done:
            self.running = [r for r in self.running if r.finish_reason is None]
            for r in done:
                self.engine.free(r.id)
                self.free_slots.append(r.slot)
        return done


def _bind(stop: Callable[[int, list[int]], bool] | None, i: int) -> Callable[[list[int]], bool] | None:
    """generate's stop(i, tokens) as request i's stop(tokens)."""
    return None if stop is None else (lambda tokens: stop(i, tokens))


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
