"""anyseek.DeepSeekV3: the whole model (embedding, decoder layers, final norm, output head, MTP modules).

    input_ids [T] + cu_seqlens, or [B, S]
      -> model.embed_tokens -> model.layers[i] (MLA + dense MLP for i < first_k_dense_replace, MLA + MoE after)
      -> model.norm -> lm_head -> logits                                   (lm_loss vs targets)
      -> mtp[k]: eh_proj([enorm(Emb(t_{i+k+1})); hnorm(h)]) -> layer -> shared_head.norm -> lm_head   (mtp_loss)

The state dict uses Hugging Face DeepseekV3 names (experts stacked, MTP under `mtp.`). Kernels are reached only
through `anyseek.kernels` (from mla.py and moe.py). Shape legend: T tokens, B documents, S row length,
D hidden, V vocab, E routed experts.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from anyseek.model.block import DecoderLayer
from anyseek.model.config import ModelConfig
from anyseek.model.layout import PackedLayout
from anyseek.model.loss import cross_entropy, linear_cross_entropy
from anyseek.model.moe import Experts, MoE, Router, RoutingStats
from anyseek.model.mtp import MTPModule, shift_in_documents
from anyseek.model.norm import RMSNorm
from anyseek.model.rope import RotaryEmbedding


@dataclass
class ModelOutput:
    """logits: input shape + [V] (model dtype; None when return_logits=False). Losses are fp32 scalars:
    loss = lm_loss + mtp_loss_weight * mtp_loss + aux_loss_alpha * balance_loss (None without targets).
    balance_loss sums the sequence-wise balance loss over MoE layers (MTP's included), each layer's divided by
    num_segments (1.0 a layer when balanced, with this batch's own counts); None without MoE or targets.
    expert_load: float [n_moe_layers, E], tokens routed to each expert in this forward, detached; rows are the main
    MoE layers then the MTP modules' (zeros when MTP did not run, i.e. without targets)."""

    logits: torch.Tensor | None
    loss: torch.Tensor | None = None
    lm_loss: torch.Tensor | None = None
    mtp_loss: torch.Tensor | None = None
    balance_loss: torch.Tensor | None = None
    expert_load: torch.Tensor | None = None


class DecoderStack(nn.Module):
    """`model.*`: embed_tokens, layers, norm."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class DeepSeekV3(nn.Module):
    def __init__(self, config: ModelConfig, device: torch.device | str | None = None, dtype: torch.dtype | None = None):
        """Build (and initialise, std init_std) the model. device="meta" allocates nothing (e.g. the 671B flavor);
        materialise later with `to_empty(device=...)` then `init_weights()` or a checkpoint load."""
        super().__init__()
        self.config = config
        with torch.device(device) if device is not None else contextlib.nullcontext():
            self.model = DecoderStack(config)
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
            self.mtp = nn.ModuleList(MTPModule(config, k) for k in range(config.num_nextn_predict_layers))
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.rotary = RotaryEmbedding(config)
        if str(device) != "meta":
            self.init_weights()
        if dtype is not None:
            self.to(dtype)

    # ---- setup ------------------------------------------------------------------------------------------------
    @torch.no_grad()
    def init_weights(self) -> None:
        """normal(0, init_std) for linear, embedding and expert weights; ones for norms; zeros for routing bias."""
        std = self.config.init_std
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, 0.0, std)
            elif isinstance(m, RMSNorm):
                nn.init.ones_(m.weight)
            elif isinstance(m, Router):
                nn.init.normal_(m.weight, 0.0, std)
                m.e_score_correction_bias.zero_()
            elif isinstance(m, Experts):
                nn.init.normal_(m.gate_up_proj, 0.0, std)
                nn.init.normal_(m.down_proj, 0.0, std)

    def _apply(self, fn, recurse=True):
        # Keep every routing bias in fp32 through .to(dtype) / .half() etc.: it accumulates tiny gamma steps.
        biases = {name: b for name, b in self.named_buffers() if name.endswith("e_score_correction_bias")}
        super()._apply(fn, recurse)
        for name, new in list(self.named_buffers()):
            if name in biases and new.dtype != torch.float32:
                owner = self.get_submodule(name.rsplit(".", 1)[0])
                owner.e_score_correction_bias = biases[name].to(device=new.device, dtype=torch.float32)
        return self

    def moe_layers(self) -> list[MoE]:
        """MoE blocks in expert_load order: main layers, then MTP modules."""
        layers = list(self.model.layers) + list(self.mtp)
        return [layer.mlp for layer in layers if isinstance(layer.mlp, MoE)]

    # ---- forward ----------------------------------------------------------------------------------------------
    def forward(
        self,
        input_ids: torch.Tensor,
        cu_seqlens: torch.Tensor | None = None,
        targets: torch.Tensor | None = None,
        max_seqlen: int | None = None,
        return_logits: bool = True,
        num_targets: Sequence[int | float | torch.Tensor] | None = None,
        num_segments: Sequence[int | float | torch.Tensor] | None = None,
    ) -> ModelOutput:
        """input_ids: packed [T] with cu_seqlens int32 [B+1] (documents; None = one document), or [B, S] rows
        (cu_seqlens must be None). targets: same shape, targets[i] follows input_ids[i], IGNORE_INDEX = ignore.
        num_targets: the denominators of the next-token loss and of each MTP depth's loss (see
        `anyseek.model.mtp.count_targets`); default this batch's own counts, i.e. means over this batch.
        num_segments: the balance loss's denominators, for the main MoE layers and then each MTP depth (see
        `anyseek.model.mtp.count_segments`); default this batch's own counts. A trainer passes both as the whole
        step's counts (over micro-batches and ranks), so that the summed micro-batch losses are the step's means."""
        shape = input_ids.shape
        ids_T, layout = self._layout(input_ids, cu_seqlens, max_seqlen)
        if targets is not None and targets.shape != shape:
            raise ValueError(f"targets shape {tuple(targets.shape)} must equal input_ids shape {tuple(shape)}")
        if num_targets is not None and len(num_targets) != 1 + len(self.mtp):
            raise ValueError(f"num_targets needs {1 + len(self.mtp)} entries (next token, then each MTP depth), "
                             f"got {len(num_targets)}")
        if num_segments is not None and len(num_segments) != 1 + len(self.mtp):
            raise ValueError(f"num_segments needs {1 + len(self.mtp)} entries (main layers, then each MTP depth), "
                             f"got {len(num_segments)}")
        targets_T = targets.reshape(-1) if targets is not None else None
        layout = layout.with_rope(*self.rotary(layout.positions))
        want_balance = targets is not None
        stats: list[RoutingStats] = []
        segments = num_segments[0] if num_segments is not None else None

        h_TD, y_TD = self.model.embed_tokens(ids_T), None
        for layer in self.model.layers:  # each FFN's residual add runs inside the next norm (DecoderLayer.forward)
            (h_TD, y_TD), layer_stats = layer(h_TD, layout, None, want_balance, pending=y_TD, defer=True,
                                              num_segments=segments)
            if layer_stats is not None:
                stats.append(layer_stats)
        # h^0 of MTP is this normed state, as inference engines feed official MTP weights
        h_TD = self.model.norm(h_TD) if y_TD is None else self.model.norm.add_forward(h_TD, y_TD)[1]
        out = ModelOutput(logits=None)
        if return_logits or targets_T is None:
            logits_TV = self.lm_head(h_TD)
            out.logits = logits_TV.view(*shape, -1) if return_logits else None
        if targets_T is not None:
            n_lm = num_targets[0] if num_targets is not None else None
            if return_logits:
                out.lm_loss = cross_entropy(logits_TV, targets_T, n_lm)
            else:  # never materialise [T, V]
                out.lm_loss = linear_cross_entropy(h_TD, self.lm_head.weight, targets_T, n_lm)
            out.loss = out.lm_loss
            if len(self.mtp):
                out.mtp_loss = self._mtp_loss(h_TD, ids_T, targets_T, layout, stats, num_targets, num_segments)
                out.loss = out.loss + self.config.mtp_loss_weight * out.mtp_loss
            balance = [s.balance_loss for s in stats if s.balance_loss is not None]
            if balance:
                out.balance_loss = torch.stack(balance).sum()
                out.loss = out.loss + self.config.aux_loss_alpha * out.balance_loss
        out.expert_load = self._expert_load(stats, ids_T.device)
        return out

    def _layout(self, input_ids: torch.Tensor, cu_seqlens: torch.Tensor | None, max_seqlen: int | None):
        if input_ids.dim() == 2:
            if cu_seqlens is not None:
                raise ValueError("cu_seqlens must be None for a [B, S] batch (every row is one document)")
            B, S = input_ids.shape
            return input_ids.reshape(-1), PackedLayout.uniform(B, S, input_ids.device)
        if input_ids.dim() != 1:
            raise ValueError(f"input_ids must be [T] (packed) or [B, S], got shape {tuple(input_ids.shape)}")
        T = input_ids.shape[0]
        if cu_seqlens is None:
            cu_seqlens = torch.tensor([0, T], dtype=torch.int32, device=input_ids.device)
        return input_ids, PackedLayout.build(cu_seqlens, T, max_seqlen)

    def _mtp_loss(self, h_TD, ids_T, targets_T, layout: PackedLayout, stats: list[RoutingStats], num_targets,
                  num_segments):
        """Mean over depths of each depth's next-token loss; appends the MTP layers' routing stats to `stats`."""
        losses = []
        for k, module in enumerate(self.mtp):
            mtp_ids_T, labels_T, inside_T = shift_in_documents(ids_T, targets_T, layout, depth=k + 1)
            segments = num_segments[k + 1] if num_segments is not None else None
            h_TD, layer_stats = module(h_TD, self.model.embed_tokens(mtp_ids_T), layout, inside_T, True, segments)
            if layer_stats is not None:
                stats.append(layer_stats)
            n_k = num_targets[k + 1] if num_targets is not None else None
            losses.append(linear_cross_entropy(module.shared_head.norm(h_TD), self.lm_head.weight, labels_T, n_k))
        return torch.stack(losses).mean()

    def _expert_load(self, stats: list[RoutingStats], device: torch.device) -> torch.Tensor | None:
        n = len(self.moe_layers())
        if n == 0:
            return None
        E = self.config.n_routed_experts
        rows = [s.load_E for s in stats] + [torch.zeros(E, device=device)] * (n - len(stats))
        return torch.stack(rows).detach()

    # ---- training helpers ------------------------------------------------------------------------------------
    @torch.no_grad()
    def update_routing_bias(self, expert_load: torch.Tensor, gamma: float | None = None) -> None:
        """Auxiliary-loss-free balancing: bias_e += gamma * sign(mean_load - load_e) in every MoE layer.
        expert_load [n_moe_layers, E] (summed over micro-batches); gamma defaults to config.bias_update_speed."""
        gamma = self.config.bias_update_speed if gamma is None else gamma
        moes = self.moe_layers()
        if expert_load.shape != (len(moes), self.config.n_routed_experts):
            raise ValueError(
                f"expert_load shape {tuple(expert_load.shape)} must be [n_moe_layers, E] = "
                f"[{len(moes)}, {self.config.n_routed_experts}]"
            )
        if not moes:
            return
        biases = [moe.gate.e_score_correction_bias for moe in moes]
        load_LE = expert_load.to(device=biases[0].device, dtype=torch.float32)
        step_LE = torch.sign(load_LE.mean(dim=1, keepdim=True) - load_LE)  # every layer in 3 kernels, not 3 each
        torch._foreach_add_(biases, list(step_LE.unbind(0)), alpha=gamma)

    def num_parameters(self, active_only: bool = False) -> int:
        """All parameters (tied weights once, MTP included); active_only counts K of the E routed experts."""
        total = sum(p.numel() for p in self.parameters())
        if active_only:
            c = self.config
            per_expert = 3 * c.hidden_size * c.moe_intermediate_size
            total -= len(self.moe_layers()) * (c.n_routed_experts - c.num_experts_per_tok) * per_expert
        return total

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs (forward + backward) per token at documents of seq_len tokens:
        6 * (weights a token multiplies: attention, active experts, router, lm_head once per prediction head, MTP's
        eh_proj; not the embedding lookup or norms) + causal attention 3 * H * (qk_dim + v_dim) * seq_len per layer."""
        c = self.config
        n_layers = c.num_hidden_layers + len(self.mtp)
        weights = self.num_parameters(active_only=True) - sum(
            m.weight.numel() for m in self.modules() if isinstance(m, RMSNorm)
        )
        weights -= self.model.embed_tokens.weight.numel()
        if c.tie_word_embeddings:
            weights += self.lm_head.weight.numel()
        weights += len(self.mtp) * self.lm_head.weight.numel()  # the shared head runs once per MTP depth
        attention = 3 * n_layers * c.num_attention_heads * (c.qk_head_dim + c.v_head_dim) * seq_len
        return 6.0 * weights + attention
