"""One decoder layer: pre-norm MLA and pre-norm feed-forward (dense MLP or DeepSeekMoE), both residual.

The same class is the trunk of every MTP module (whose parameters sit at `mtp.{k}.*`)."""

from __future__ import annotations

import torch
from torch import nn

from anyseek.model.config import ModelConfig
from anyseek.model.mla import MLA
from anyseek.model.moe import MLP, MoE
from anyseek.model.norm import RMSNorm
from anyseek.model.packing import Packing


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = MLA(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        if config.is_moe_layer(layer_idx):
            self.mlp = MoE(config)
        else:
            self.mlp = MLP(config.hidden_size, config.intermediate_size)

    @property
    def is_moe(self) -> bool:
        return isinstance(self.mlp, MoE)

    def forward(self, h_TD: torch.Tensor, pack: Packing) -> torch.Tensor:
        """h [T, D] -> [T, D]."""
        h_TD = h_TD + self.self_attn(self.input_layernorm(h_TD), pack)
        return h_TD + self.mlp(self.post_attention_layernorm(h_TD), pack)
