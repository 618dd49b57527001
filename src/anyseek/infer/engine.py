"""The decode engine: prefill, step decode and MTP drafting of a batch of sequences over one paged latent cache.

    prefill(seqs)          new prompts, packed: the training attention kernels; fills the cache; last-token logits
    decode(seqs, ids)      one token per sequence: absorbed attention over the cache (a CUDA graph per batch bucket)
    extend(seqs, ids)      several tokens per sequence over the cache (speculative verification), eager
    mtp_*                  the model's MTP module 0 as a drafter, with its own layer in the cache

The host tracks every sequence's length and pages (`PagedLatentCache`), so a step's inputs are built on the host and
copied in one transfer; the only device -> host transfer of a step is the caller reading the sampled ids.
Shape legend: B sequences, T new tokens, D hidden, V vocab, M table width (pages).
"""

from __future__ import annotations

import warnings

import torch

from anyseek.infer.cache import PAGE, PagedLatentCache
from anyseek.infer.cpu_decode import CpuDecoder, supports
from anyseek.infer.layers import Step, layer_forward
from anyseek.infer.sampling import upload_ints

GRAPH_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)


class Engine:
    def __init__(self, model, max_batch: int, max_len: int, cuda_graphs: bool = True, page: int | None = None,
                 cache_tokens: int | None = None):  # fmt: skip
        """model: a DeepSeekV3 (eval mode, any dtype). max_batch sequences at once, each at most max_len tokens
        (prompt + generated + 1 for a speculative draft). cache_tokens: the page pool's size in tokens (default
        max_batch * max_len, every sequence at its longest; at least one sequence's); the CPU step keeps one whole
        block of max_len tokens per sequence, so there the pool is always the default."""
        cfg = model.config
        self.model, self.config = model, cfg
        self.device = model.lm_head.weight.device
        self.dtype = model.lm_head.weight.dtype
        self.n_main, self.n_mtp = cfg.num_hidden_layers, len(model.mtp)
        kw = {"page": page} if page else {}
        self.max_batch, self.max_len = max_batch, max_len
        per_seq = -(-max_len // (page or PAGE))
        cpu = supports(model)
        pages = max_batch * per_seq
        if cache_tokens is not None and not cpu:
            pages = max(per_seq, -(-cache_tokens // (page or PAGE)))
        self.cache = PagedLatentCache(self.n_main + self.n_mtp, pages + 1, cfg.kv_lora_rank, cfg.qk_rope_head_dim,
                                      self.dtype, self.device, **kw)  # fmt: skip
        self.num_pages = pages  # page 0 (scratch) not counted
        self.width = per_seq
        self.use_graphs = cuda_graphs and self.device.type == "cuda"
        self._graphs: dict[int, tuple] = {}
        self._turn = 0  # which of a graph's two host input buffers the next step fills
        self.cpu = CpuDecoder(model, self.cache, max_len, per_seq) if cpu else None  # few-op CPU steps
        # cos/sin of every position a sequence's pages hold, computed once: a step gathers its rows (two kernels,
        # where computing them took six): the values the rotary embedding gives those positions (elementwise)
        self._rope_table = model.rotary(torch.arange(per_seq * self.cache.page, device=self.device))

    def pages_needed(self, n_tokens: int) -> int:
        """Pages a sequence of at most `n_tokens` cached tokens holds at its longest (on the CPU: its whole block)."""
        return self.width if self.cpu is not None else self.cache.pages_for(min(n_tokens, self.max_len))

    @torch.no_grad()
    def warm_up(self) -> None:
        """Capture the decode graph of every batch bucket up to max_batch now (a server's first requests then pay
        no capture)."""
        if self.use_graphs:
            for bucket in GRAPH_BUCKETS:
                if self.use_graphs and bucket not in self._graphs:
                    self._capture(bucket)
                if bucket >= self.max_batch:
                    break

    # ---- inputs -------------------------------------------------------------------------------------------------
    def _upload(self, *rows: list[int]) -> list[torch.Tensor]:
        """Host lists -> device int64 tensors, in one transfer."""
        return list(upload_ints([v for r in rows for v in r], self.device).split([len(r) for r in rows]))

    def _rope(self, positions_T: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin fp32 [T, R/2] of positions [T] (each within a sequence's pages)."""
        cos_PR, sin_PR = self._rope_table
        return cos_PR.index_select(0, positions_T), sin_PR.index_select(0, positions_T)

    def _cached_step(self, seq_ids: list[int], starts: list[int], counts: list[int], extra: list[int]) -> tuple:
        """Step for `counts[b]` new tokens of sequence b at positions starts[b].. attending over the cache."""
        pos, slots, table, lens = [], [], [], []
        for sid, s, n in zip(seq_ids, starts, counts):
            self.cache.reserve(sid, s + n)
            pos += range(s, s + n)
            slots += self.cache.slots(sid, s, s + n)
            row = self.cache.table_row(sid, self.width)
            table += row * n
            lens += range(s + 1, s + n + 1)
        ids, pos_t, slots_t, table_t, lens_t = self._upload(extra, pos, slots, table, lens)
        cos, sin = self._rope(pos_t)
        step = Step(pos_t, cos, sin, slots_t, block_table=table_t.view(-1, self.width).to(torch.int32),
                    kv_lens=lens_t.to(torch.int32))  # fmt: skip
        return ids, step

    # ---- the stack --------------------------------------------------------------------------------------------
    def _trunk(self, ids_T: torch.Tensor, step: Step) -> torch.Tensor:
        """ids [T] -> the final-normed hidden state h [T, D] (MTP's h^0)."""
        h_TD, y_TD = self.model.model.embed_tokens(ids_T), None
        for i, layer in enumerate(self.model.model.layers):  # each FFN's residual add in the next norm
            h_TD, y_TD = layer_forward(layer, h_TD, step, self.cache, i, y_TD)
        norm = self.model.model.norm
        return norm(h_TD) if y_TD is None else norm.add_forward(h_TD, y_TD)[1]

    @torch.no_grad()
    def prefill(self, seq_ids: list[int], prompts: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor, Step]:
        """New sequences (pages are taken here) -> (logits fp32 [B, V] at each prompt's last token, h [T, D] of every
        prompt token, the Step, for MTP's prefill)."""
        lens = [len(p) for p in prompts]
        pos, slots, cu = [], [], [0]
        for sid, n in zip(seq_ids, lens):
            self.cache.add(sid)
            self.cache.reserve(sid, self.max_len if self.cpu is not None else n)  # CPU: a whole block at once
            pos += range(n)
            slots += self.cache.slots(sid, 0, n)
            cu.append(cu[-1] + n)
        if self.cpu is not None:
            self.cpu.refresh()  # the weights may have changed since the last request (training in between)
        ids, pos_t, slots_t, cu_t = self._upload([t for p in prompts for t in p], pos, slots, cu)
        cos, sin = self._rope(pos_t)
        step = Step(pos_t, cos, sin, slots_t, cu_seqlens=cu_t.to(torch.int32), max_seqlen=max(lens))
        h_TD = self._trunk(ids, step)
        last = cu_t[1:] - 1
        for sid, n in zip(seq_ids, lens):
            self.cache.seqs[sid].length = n
        return self.model.lm_head(h_TD.index_select(0, last)).float(), h_TD, step

    @torch.no_grad()
    def extend(self, seq_ids: list[int], tokens: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """tokens[b] appended to sequence b (eager) -> (logits fp32 [T, V], h [T, D]) for every new token, in order.
        The cache lengths move past the new tokens; `rollback` shortens them again."""
        starts = [self.cache.seqs[s].length for s in seq_ids]
        ids, step = self._cached_step(seq_ids, starts, [len(t) for t in tokens], [t for ts in tokens for t in ts])
        h_TD = self._trunk(ids, step)
        for sid, s, ts in zip(seq_ids, starts, tokens):
            self.cache.seqs[sid].length = s + len(ts)
        return self.model.lm_head(h_TD).float(), h_TD

    def rollback(self, seq_id: int, length: int) -> None:
        """Forget cached tokens past `length` (rejected drafts); they are overwritten by the next write."""
        self.cache.seqs[seq_id].length = length

    def free(self, seq_id: int) -> None:
        self.cache.free(seq_id)

    # ---- one-token decode, graph-captured on CUDA -------------------------------------------------------------
    @torch.no_grad()
    def decode(self, seq_ids: list[int], ids: list[int], prev: tuple[torch.Tensor, list[int]] | None = None
               ) -> torch.Tensor:  # fmt: skip
        """One new token per sequence -> logits fp32 [B, V] (a view into a static buffer when graph-replayed: read it
        before the next call). prev = (tokens [B'] on the device, src [B]): row b's token is tokens[src[b]] where
        src[b] >= 0, else ids[b]; so a step can be launched before the previous one's sampled tokens reach the host
        (`Generator`'s lookahead; with graphs no host sync, elsewhere they are read back first)."""
        B = len(seq_ids)
        bucket = next((b for b in GRAPH_BUCKETS if b >= B), B)
        graph = (self._graphs.get(bucket) or self._capture(bucket)) if self.use_graphs else None
        if prev is not None and graph is None:  # no graph input to resolve them in: read them back
            got = prev[0].tolist()
            ids, prev = [got[j] if j >= 0 else t for t, j in zip(ids, prev[1])], None
        if self.cpu is not None:
            return self._cpu_decode(seq_ids, ids)
        if graph is None:
            return self.extend(seq_ids, [[t] for t in ids])[0]
        starts = [self.cache.seqs[s].length for s in seq_ids]
        pos, slots, table, lens = [], [], [], []
        for sid, s in zip(seq_ids, starts):
            self.cache.reserve(sid, s + 1)
            pos.append(s)
            slots += self.cache.slots(sid, s, s + 1)
            table += self.cache.table_row(sid, self.width)
            lens.append(s + 1)
        pad = bucket - B  # padded rows read and write the scratch page 0
        if prev is not None:  # -(j + 1) marks "the previous step's token j" (resolved on the device below)
            ids = [-j - 1 if j >= 0 else t for t, j in zip(ids, prev[1])]
        row = [ids + [0] * pad, pos + [0] * pad, slots + [0] * pad, table + [0] * (pad * self.width),
               lens + [1] * pad]  # fmt: skip
        g, static_in, logits, host_in = graph
        # two host buffers in turn: this one's last copy (two steps ago) is done, as the caller has read that step's
        # sampled ids since; the previous step's copy may still be in flight (lookahead)
        buf = host_in[self._turn % 2]
        self._turn += 1
        buf.copy_(torch.tensor([v for r in row for v in r], dtype=torch.int64))
        static_in.copy_(buf, non_blocking=True)
        if prev is not None:
            tok = static_in[:B]
            got = prev[0].index_select(0, (-tok - 1).clamp(0, prev[0].numel() - 1))
            tok.copy_(torch.where(tok < 0, got, tok))
        g.replay()
        for sid, s in zip(seq_ids, starts):
            self.cache.seqs[sid].length = s + 1
        return logits[:B]

    def _cpu_decode(self, seq_ids: list[int], ids: list[int]) -> torch.Tensor:
        """`decode` on the CPU (`cpu_decode.CpuDecoder`): each sequence's cached rows are one block of the cache
        (a batch on consecutive blocks: one view; else the blocks are gathered), masked past each sequence's end."""
        c, P, B = self.cache, self.cache.page, len(seq_ids)
        starts = [c.seqs[s].length for s in seq_ids]
        slots, blocks = [], []
        for sid, s in zip(seq_ids, starts):
            c.reserve(sid, s + 1)
            pages = c.seqs[sid].pages
            slots.append(pages[s // P] * P + s % P)
            blocks.append(self.cpu.block_of(pages))
        if None in blocks:  # pages not taken by `prefill` (cannot happen with its whole-block reservation)
            return self.extend(seq_ids, [[t] for t in ids])[0]
        S = max(starts) + 1
        extra = [] if blocks == list(range(blocks[0], blocks[0] + B)) else blocks
        flat = torch.tensor(ids + starts + slots + extra, dtype=torch.int64)
        ids_t, pos_t, slots_t = flat[:B], flat[B : 2 * B], flat[2 * B : 3 * B]
        rows = flat[3 * B :] if extra else blocks[0]
        mask = None
        if min(starts) + 1 < S:
            mask = torch.zeros(B, 1, S).masked_fill_(torch.arange(S) > pos_t[:, None, None], float("-inf"))
        logits = self.cpu.step(ids_t, pos_t, slots_t, rows, mask, S)
        for sid, s in zip(seq_ids, starts):
            c.seqs[sid].length = s + 1
        return logits

    def _graph_body(self, static_in: torch.Tensor, bucket: int) -> torch.Tensor:
        ids, pos, slots, table, lens = static_in.split([bucket, bucket, bucket, bucket * self.width, bucket])
        cos, sin = self._rope(pos)
        step = Step(pos, cos, sin, slots, block_table=table.view(bucket, self.width).to(torch.int32),
                    kv_lens=lens.to(torch.int32))  # fmt: skip
        return self.model.lm_head(self._trunk(ids, step)).float()

    def _capture(self, bucket: int):
        static_in = torch.zeros(bucket * (4 + self.width), dtype=torch.int64, device=self.device)
        static_in[4 * bucket + bucket * self.width - bucket :] = 1  # kv_lens 1 on the scratch page
        try:
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for _ in range(2):  # warm up: Triton compiles, caches fill
                    self._graph_body(static_in, bucket)
            torch.cuda.current_stream().wait_stream(stream)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                logits = self._graph_body(static_in, bucket)
        except Exception as e:  # noqa: BLE001 - a backend that syncs with the host cannot be captured: decode eagerly
            warnings.warn(f"anyseek: decoding without CUDA graphs ({type(e).__name__}: {e})", RuntimeWarning,
                          stacklevel=3)  # fmt: skip
            self.use_graphs = False
            return None
        self._graphs[bucket] = (g, static_in, logits, [torch.empty_like(static_in, device="cpu").pin_memory()
                                                       for _ in range(2)])  # fmt: skip
        return self._graphs[bucket]

    # ---- MTP drafting -----------------------------------------------------------------------------------------
    def _mtp(self, h_prev_TD: torch.Tensor, next_ids_T: torch.Tensor, step: Step) -> torch.Tensor:
        """MTP module 0: h^0 [T, D] and the next tokens' ids [T] -> logits fp32 [T, V] of the token after those."""
        mtp = self.model.mtp[0]
        emb_TD = self.model.model.embed_tokens(next_ids_T)
        h_TD = mtp.eh_proj(torch.cat([mtp.enorm(emb_TD), mtp.hnorm(h_prev_TD)], dim=-1))
        h_TD, y_TD = layer_forward(mtp, h_TD, step, self.cache, self.n_main)
        return self.model.lm_head(mtp.shared_head.norm.add_forward(h_TD, y_TD)[1]).float()

    @torch.no_grad()
    def mtp_prefill(self, h_TD: torch.Tensor, step: Step, prompts: list[list[int]], first: list[int]) -> torch.Tensor:
        """After `prefill`: MTP over every prompt position j (h_j with t_{j+1}; the last takes the first sampled
        token) -> draft logits [B, V] for the token after `first`."""
        nxt = [t for p, f in zip(prompts, first) for t in p[1:] + [f]]
        (ids,) = self._upload(nxt)
        logits_TV = self._mtp(h_TD, ids, step)
        return logits_TV.index_select(0, step.cu_seqlens[1:].long() - 1)

    @torch.no_grad()
    def mtp_extend(
        self, seq_ids: list[int], starts: list[int], h_TD: torch.Tensor, nxt: list[list[int]]
    ) -> torch.Tensor:
        """MTP at positions starts[b].. of sequence b (h rows in order, next tokens nxt[b]) -> draft logits [B, V]
        at each sequence's last new position."""
        ids, step = self._cached_step(seq_ids, starts, [len(n) for n in nxt], [t for n in nxt for t in n])
        logits_TV = self._mtp(h_TD, ids, step)
        ends = torch.tensor([len(n) for n in nxt], device=self.device).cumsum(0) - 1
        return logits_TV.index_select(0, ends)
