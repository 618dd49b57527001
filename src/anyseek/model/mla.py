"""Multi-head Latent Attention (DeepSeek-V2/V3) on packed batches.

q:  x -> q_a_proj -> q_a_layernorm -> q_b_proj (or q_proj) -> [T, H, nope | rope]
kv: x -> kv_a_proj_with_mqa -> [latent (kv_lora) | k_pe (rope, one head shared by all)]
    latent -> kv_a_layernorm -> kv_b_proj -> [T, H, nope | v]
RoPE touches only the rope parts; the attention itself runs behind `anyseek.kernels.mla_attention`.

Shape legend: T tokens, D hidden, H heads, N nope dim, R rope dim, V v dim, L kv_lora_rank, Q q_lora_rank.
"""

from __future__ import annotations

import torch
from torch import nn

from anyseek import kernels
from anyseek.model.concat import fused_linear, split_last
from anyseek.model.config import ModelConfig
from anyseek.model.layout import PackedLayout
from anyseek.model.norm import RMSNorm
from anyseek.model.rope import rope_rows, rope_tail_


class MLA(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        c = config
        self.n_heads, self.nope, self.rope, self.v_dim = (
            c.num_attention_heads,
            c.qk_nope_head_dim,
            c.qk_rope_head_dim,
            c.v_head_dim,
        )
        self.kv_lora_rank = c.kv_lora_rank
        self.rope_interleave = c.rope_interleave
        self.softmax_scale = c.softmax_scale
        H, C = c.num_attention_heads, c.qk_head_dim
        if c.q_lora_rank is None:
            self.q_proj = nn.Linear(c.hidden_size, H * C, bias=False)
        else:
            self.q_a_proj = nn.Linear(c.hidden_size, c.q_lora_rank, bias=False)
            self.q_a_layernorm = RMSNorm(c.q_lora_rank, c.rms_norm_eps)
            self.q_b_proj = nn.Linear(c.q_lora_rank, H * C, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(c.hidden_size, c.kv_lora_rank + c.qk_rope_head_dim, bias=False)
        self.kv_a_layernorm = RMSNorm(c.kv_lora_rank, c.rms_norm_eps)
        self.kv_b_proj = nn.Linear(c.kv_lora_rank, H * (c.qk_nope_head_dim + c.v_head_dim), bias=False)
        self.o_proj = nn.Linear(H * c.v_head_dim, c.hidden_size, bias=False)

    def joined_weights(self) -> list[tuple[torch.Tensor, ...]]:
        """Weights the forward uses side by side (`model/concat.py`)."""
        return [] if hasattr(self, "q_proj") else [(self.q_a_proj.weight, self.kv_a_proj_with_mqa.weight)]

    def forward(self, x_TD: torch.Tensor, layout: PackedLayout) -> torch.Tensor:
        """x [T, D] -> [T, D]; attention stays inside each document of `layout`."""
        T, H = x_TD.shape[0], self.n_heads
        if hasattr(self, "q_proj"):
            q_TQ = self.q_proj(x_TD)
            kv_a_TX = self.kv_a_proj_with_mqa(x_TD)
        else:  # both down-projections read x: one matmul (and one for each gradient) instead of two
            q_a_TQ, kv_a_TX = fused_linear(x_TD, [self.q_a_proj, self.kv_a_proj_with_mqa]).split(
                [self.q_a_proj.out_features, self.kv_a_proj_with_mqa.out_features], dim=-1
            )
            q_TQ = self.q_b_proj(self.q_a_layernorm(q_a_TQ))
        # the rope part rotated in place: no split/cat of the query either way
        q_THC = rope_tail_(q_TQ, layout.cos, layout.sin, H, self.rope, self.rope_interleave).view(T, H, -1)

        latent_TL, k_pe_TR = kv_a_TX.split([self.kv_lora_rank, self.rope], dim=-1)
        k_pe_TR = rope_rows(k_pe_TR, layout.cos, layout.sin, self.rope_interleave)
        kv_THX = self.kv_b_proj(self.kv_a_layernorm(latent_TL)).view(T, H, self.nope + self.v_dim)
        k_nope_THN, v_THV = split_last(kv_THX, [self.nope, self.v_dim])  # copy-free backward

        out_THV = kernels.mla_attention(
            q_THC, k_nope_THN, k_pe_TR, v_THV, layout.cu_seqlens, layout.max_seqlen, self.softmax_scale, True
        )
        return self.o_proj(out_THV.reshape(T, H * self.v_dim))
