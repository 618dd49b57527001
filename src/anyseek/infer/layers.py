"""The model's layers run against the paged latent cache, reading the model's own modules and weights.

MLA in two forms (exactly the training forward's maths; only the order of the products changes):
- prefill (`Step.cu_seqlens` set): new sequences attend to themselves through the training kernels
  (`kernels.mla_attention`: kv_b_proj expands the latent to per-head k_nope and v), and their latents fill the cache;
- absorbed (`Step.block_table` set): W_UK (kv_b_proj's k rows) is folded into the query, q_lat[h] = q_nope[h] @ W_UK[h],
  each row attends over the cached latents with `kernels.mla_decode`, and W_UV is applied to the latent output.
  Per token and head that reads L + R cached values instead of N + R keys and V values.

Shape legend: T new tokens, D hidden, H heads, N nope dim, R rope dim, V v dim, L kv_lora_rank, M table width.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from anyseek import kernels
from anyseek.kernels import registry
from anyseek.infer.cache import PagedLatentCache
from anyseek.model.concat import adjacent_weights, join_rows, joined_view
from anyseek.model.mla import MLA
from anyseek.model.moe import MoE


def join_weights(model: torch.nn.Module) -> None:
    """Lay out, for inference, the weights that are multiplied side by side row after row in one buffer each
    (`model.concat.join_rows`): the groups the model joins (gate|up of the dense MLPs and shared experts, q_a|kv_a),
    which it would otherwise concatenate, a copy of the weights, at every forward (16B: 23 MB a shared-expert layer,
    90 MB the dense one), and MLA's q_proj|kv_a_proj_with_mqa where there is no q LoRA, which the decode step then
    runs as one matmul (`_pair`). The values stay the same. For models loaded to serve or generate, not
    during training (the trainer's working copy lays out its own)."""
    pairs = [(m.q_proj.weight, m.kv_a_proj_with_mqa.weight) for m in model.modules()
             if isinstance(m, MLA) and hasattr(m, "q_proj") and _plain(m.q_proj, m.kv_a_proj_with_mqa)]  # fmt: skip
    join_rows(adjacent_weights(model) + pairs)


def _plain(*layers) -> bool:
    return all(type(m) is torch.nn.Linear and m.bias is None for m in layers)


@dataclass
class Step:
    """Where the T new tokens of one forward sit: positions [T] (int64), cos/sin fp32 [T, R/2], slots [T] (flat cache
    rows, int64), and either cu_seqlens/max_seqlen (prefill of whole new sequences) or block_table int32 [T, M] and
    kv_lens int32 [T] = position + 1 (absorbed attention over the cache, the new tokens included)."""

    positions: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor
    slots: torch.Tensor
    cu_seqlens: torch.Tensor | None = None
    max_seqlen: int = 0
    block_table: torch.Tensor | None = None
    kv_lens: torch.Tensor | None = None


def mla_forward(m: MLA, x_TD: torch.Tensor, step: Step, cache: PagedLatentCache, layer: int) -> torch.Tensor:
    """MLA of the new tokens x [T, D] -> [T, D]; writes their latents to attention layer `layer` of the cache."""
    T, H, N, R, L = x_TD.shape[0], m.n_heads, m.nope, m.rope, m.kv_lora_rank
    if hasattr(m, "q_proj"):
        q_TQ, kv_a_TX = _pair(m.q_proj, m.kv_a_proj_with_mqa, x_TD)
    else:
        q_a_TQ, kv_a_TX = _pair(m.q_a_proj, m.kv_a_proj_with_mqa, x_TD)
        q_TQ = m.q_b_proj(m.q_a_layernorm(q_a_TQ))
    q_nope_THN, q_pe_THR = q_TQ.view(T, H, N + R).split([N, R], dim=-1)
    if step.cu_seqlens is not None:  # prefill: the training path (which also needs the latent and k_pe)
        # `apply_rope`'s rotation (and output layout) in one kernel each on GPUs, read from the projections in place
        q_pe_THR = kernels.rope_rotate(q_pe_THR, step.cos, step.sin, interleaved_in=m.rope_interleave)
        latent_TL, k_pe_TR = kv_a_TX.split([L, R], dim=-1)
        latent_TL = m.kv_a_layernorm(latent_TL)
        k_pe_TR = kernels.rope_rotate(k_pe_TR, step.cos, step.sin, interleaved_in=m.rope_interleave)
        cache.write(layer, step.slots, latent_TL, k_pe_TR)
        k_nope_THN, v_THV = m.kv_b_proj(latent_TL).view(T, H, N + m.v_dim).split([N, m.v_dim], dim=-1)
        q_THC = torch.cat([q_nope_THN, q_pe_THR], dim=-1)
        out_THV = kernels.mla_attention(q_THC, k_nope_THN, k_pe_TR.contiguous(), v_THV, step.cu_seqlens,
                                        step.max_seqlen, m.softmax_scale, True)  # fmt: skip
    else:  # the cache rows and the query's rope written by one kernel, read by the absorbed attention
        dt = q_nope_THN.dtype
        # the absorbed query [q_nope W_UK | rope(q_pe)] and the heads' outputs written where they are read next:
        # the products into strided views (cuBLAS takes their row stride), the rotation straight into its columns
        q_THX = torch.empty(T, H, L + R, dtype=dt, device=x_TD.device)
        norm = m.kv_a_layernorm
        kernels.mla_cache_write(cache.flat(layer), step.slots, kv_a_TX, norm.weight, norm.eps, step.cos, step.sin,
                                m.rope_interleave, q_pe_THR, q_THX[..., L:])  # fmt: skip
        w_HXL = m.kv_b_proj.weight.view(H, N + m.v_dim, L)
        w_uk_HNL, w_uv_HVL = w_HXL[:, :N], w_HXL[:, N:]
        c = cache.layer(layer)
        torch.bmm(q_nope_THN.transpose(0, 1), w_uk_HNL.to(dt), out=q_THX[..., :L].transpose(0, 1))
        o_lat_THL = kernels.mla_decode(q_THX.to(c.dtype), c, step.block_table, step.kv_lens, L, m.softmax_scale)
        out_THV = torch.empty(T, H, m.v_dim, dtype=dt, device=x_TD.device)
        torch.bmm(o_lat_THL.to(dt).transpose(0, 1), w_uv_HVL.transpose(1, 2).to(dt), out=out_THV.transpose(0, 1))
    return m.o_proj(out_THV.reshape(T, H * m.v_dim))


def _pair(a: torch.nn.Module, b: torch.nn.Module, x_TD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """a(x) and b(x) for two projections of the same input: one matmul where their weights lie together
    (`join_weights`), else each its own (no per-step copy of the weights to join them)."""
    w = joined_view([a.weight, b.weight], 0) if _plain(a, b) else None
    if w is None:
        return a(x_TD), b(x_TD)
    return F.linear(x_TD, w).split([a.out_features, b.out_features], dim=-1)


DENSE_MOE_TOKENS = 64  # decode batches up to this size run every expert on every token (below)
# How decoding runs the routed experts (`benchmarks/decode_experts.py` compares them): "kernel" the routed-experts
# kernel seam at every batch size (reads only the chosen experts; graph-safe with the Triton backend), "sizes" the
# PyTorch paths by batch size (below), "auto" the kernel where its Triton backend runs, else by size. 16B on an H200
# (stop 46, CUDA graphs): kernel 6.15 / 6.30 / 6.45 ms a step at batch 1 / 8 / 64, sizes 9.90 / 11.14 / 14.24.
DECODE_EXPERTS = os.environ.get("ANYSEEK_DECODE_EXPERTS", "auto")
if DECODE_EXPERTS not in ("auto", "kernel", "sizes"):
    raise ValueError(f"ANYSEEK_DECODE_EXPERTS must be auto, kernel or sizes, got {DECODE_EXPERTS!r}")


def ffn_forward(mlp: torch.nn.Module, x_TD: torch.Tensor) -> torch.Tensor:
    """The layer's MLP or MoE, for decoding: no host sync, so the step can be graph-captured.

    Routed experts: through the routed_experts kernel seam where its Triton backend runs (DECODE_EXPERTS), else by
    batch size: T*K <= E/2 (small batches) reads only the chosen experts' weights (gathered); T <= DENSE_MOE_TOKENS
    runs all E experts on all T tokens with zero weight for the unchosen ones (each weight read once; the wasted FLOPs
    are cheap at decode sizes); larger T (prefill) goes through the kernel seam.
    """
    if not isinstance(mlp, MoE):
        return mlp(x_TD)
    ids_TK, w_TK = mlp.gate.choose(x_TD)
    T, K = ids_TK.shape
    shared = mlp.shared_experts if hasattr(mlp, "shared_experts") else None
    if _kernel_experts(x_TD) or (T * K * 2 > mlp.n_experts and T > DENSE_MOE_TOKENS):
        # the shared experts' output summed inside the routed experts' combine (no add of its own)
        return mlp.experts(x_TD, ids_TK, w_TK, add_TD=None if shared is None else shared(x_TD))
    elif T * K * 2 > mlp.n_experts:
        y_TD = _dense_experts(mlp, x_TD, ids_TK, w_TK)
    else:
        gate_up_MFD = mlp.experts.gate_up_proj.index_select(0, ids_TK.reshape(-1))
        down_MDI = mlp.experts.down_proj.index_select(0, ids_TK.reshape(-1))
        x_MD1 = x_TD.repeat_interleave(K, dim=0)[:, :, None]
        h_MF = torch.bmm(gate_up_MFD, x_MD1)[..., 0]
        I = down_MDI.shape[-1]
        act_MI = F.silu(h_MF[:, :I]) * h_MF[:, I:]
        act_MI = (act_MI * w_TK.reshape(-1, 1)).to(act_MI.dtype)
        y_MD = torch.bmm(down_MDI, act_MI[:, :, None])[..., 0]
        y_TD = y_MD.float().view(T, K, -1).sum(dim=1).to(x_TD.dtype)
    return y_TD if shared is None else y_TD + shared(x_TD)


def _kernel_experts(x_TD: torch.Tensor) -> bool:
    """Whether decoding runs the routed experts through the kernel seam at this batch size (DECODE_EXPERTS)."""
    if DECODE_EXPERTS != "auto":
        return DECODE_EXPERTS == "kernel"
    return registry.choose("routed_experts", x_TD)[1] == "triton"


def _dense_experts(mlp: MoE, x_TD: torch.Tensor, ids_TK: torch.Tensor, w_TK: torch.Tensor) -> torch.Tensor:
    """sum_k w[t,k] * expert_{ids[t,k]}(x[t]) as every expert on every token, weight 0 where not chosen."""
    E = mlp.n_experts
    w_ET = torch.zeros(x_TD.shape[0], E, device=x_TD.device, dtype=torch.float32).scatter_(1, ids_TK, w_TK.float()).T
    gate_up_EFD, down_EDI = mlp.experts.gate_up_proj, mlp.experts.down_proj
    I = down_EDI.shape[-1]
    h_ETF = torch.matmul(x_TD.to(gate_up_EFD.dtype), gate_up_EFD.transpose(1, 2))  # [E, T, 2I]
    act_ETI = F.silu(h_ETF[..., :I]) * h_ETF[..., I:]
    act_ETI = (act_ETI * w_ET[:, :, None]).to(act_ETI.dtype)
    y_ETD = torch.bmm(act_ETI, down_EDI.transpose(1, 2))
    return y_ETD.float().sum(dim=0).to(x_TD.dtype)


def layer_forward(layer, h_TD: torch.Tensor, step: Step, cache: PagedLatentCache, index: int,
                  pending: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """One decoder layer (main or an MTP module's trunk) on the new tokens; `index` is its attention-cache layer.
    As the training forward (`DecoderLayer.forward`), each residual add runs inside the norm after it
    (`RMSNorm.add_forward`, one kernel on GPUs): `pending` is the previous layer's FFN output still to be added to
    h, and the result is (h, y) with this layer's FFN output y not yet added (the caller's next norm adds it)."""
    if pending is None:
        x_TD = layer.input_layernorm(h_TD)
    else:
        h_TD, x_TD = layer.input_layernorm.add_forward(h_TD, pending)
    a_TD = mla_forward(layer.self_attn, x_TD, step, cache, index)
    h_TD, x_TD = layer.post_attention_layernorm.add_forward(h_TD, a_TD)
    return h_TD, ffn_forward(layer.mlp, x_TD)
