"""One decoder layer: pre-norm MLA and pre-norm feed-forward (dense MLP or DeepSeekMoE), both residual.

The same class is the trunk of every MTP module (whose parameters sit at `mtp.{k}.*`)."""

from __future__ import annotations

import torch
from torch import nn

from anyseek.model.config import ModelConfig
from anyseek.model.layout import PackedLayout
from anyseek.model.mla import MLA
from anyseek.model.moe import MLP, MoE, RoutingStats
from anyseek.model.norm import RMSNorm


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

    def forward(
        self,
        h_TD: torch.Tensor,
        layout: PackedLayout,
        token_mask_T: torch.Tensor | None = None,
        want_balance_loss: bool = False,
        pending: torch.Tensor | None = None,
        defer: bool = False,
        num_segments: float | torch.Tensor | None = None,
    ) -> tuple[torch.Tensor | tuple[torch.Tensor, torch.Tensor], RoutingStats | None]:
        """h [T, D] -> (h [T, D], the MoE's RoutingStats or None for a dense layer). token_mask_T,
        want_balance_loss and num_segments: see MoE.forward.

        The residual adds can travel with the next norm (one kernel each way, `RMSNorm.add_forward`): `pending`
        [T, D] is a previous layer's FFN output still to be added to h (the input is h + pending), and with `defer`
        the layer returns ((h, y), stats) for h + y instead of adding its own FFN output y. The model's layer loop
        uses both; one layer alone computes the same thing either way."""
        if pending is None:
            x_TD = self.input_layernorm(h_TD)
        else:
            h_TD, x_TD = self.input_layernorm.add_forward(h_TD, pending)
        a_TD = self.self_attn(x_TD, layout)
        if not self.is_moe:
            h_TD, x_TD = self.post_attention_layernorm.add_forward(h_TD, a_TD)  # h + a, and its norm
            y_TD, stats = self.mlp(x_TD), None
        else:  # the norm once per reader of it, so that its backward sums their gradients (no [T, D] adds)
            h_TD, *x_TD = self.post_attention_layernorm.add_forward(h_TD, a_TD, self.mlp.input_copies)
            y_TD, stats = self.mlp(x_TD, layout, token_mask_T, want_balance_loss, num_segments)
        return ((h_TD, y_TD) if defer else h_TD + y_TD), stats
