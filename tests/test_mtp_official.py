"""MTP against an independent, hand-written module in the official DeepSeek-V3 layout, fp32 on CPU.

A tiny random checkpoint is written with the official names: the main model, then MTP module 0 as
`model.layers.{N}` (N = num_hidden_layers) holding `enorm`, `hnorm`, `eh_proj`, a whole decoder layer,
`shared_head.norm`, and copies of the embedding (`embed_tokens`) and the head (`shared_head.head`); experts per
expert. anyseek loads it by those names. The reference reads the same tensors by name and computes

    h'_i = eh_proj([enorm(Emb(t_{i+1})) ; hnorm(h^0_i)]),  h^1 = DecoderLayer(h'),  logits = head(shared_head.norm(h^1))

with h^0 the main model's last hidden state after its final norm (transformers' `last_hidden_state`), the decoder
layer transformers' own DeepseekV3DecoderLayer, the norms written out here. Training's MTP loss and the inference
drafter (`Engine.mtp_prefill` / `mtp_extend`) must both match it.
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from anyseek.constants import IGNORE_INDEX
from anyseek.hf import config_to_hf, load_pretrained
from anyseek.infer.engine import Engine
from anyseek.model.config import ModelConfig

transformers = pytest.importorskip("transformers")

N = 2  # main layers: layer 0 dense, layer 1 MoE; the MTP layer (index N) is MoE too
CONFIG = {"vocab_size": 256, "hidden_size": 64, "intermediate_size": 96, "moe_intermediate_size": 24,
          "num_hidden_layers": N, "first_k_dense_replace": 1, "num_attention_heads": 4, "q_lora_rank": 32,
          "kv_lora_rank": 16, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 12, "n_routed_experts": 8,
          "num_experts_per_tok": 3, "n_shared_experts": 1, "n_group": 4, "topk_group": 2, "routed_scaling_factor": 2.5,
          "num_nextn_predict_layers": 1, "max_position_embeddings": 64, "rope_interleave": True}  # fmt: skip
MTP = f"model.layers.{N}"


def _randomize(module: torch.nn.Module, g: torch.Generator) -> None:
    """Bold random weights (transformers initialises experts to zero on CPU): matrices N(0, 0.1), vectors (the norms)
    in [0.5, 1.5], routing biases N(0, 0.1)."""
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.1 if p.dim() > 1 else torch.rand(p.shape, generator=g) + 0.5)
        for name, b in module.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.randn(b.shape, generator=g) * 0.1)


def _official_names(state: dict[str, torch.Tensor], prefix: str = "") -> dict[str, torch.Tensor]:
    """transformers' state dict -> official checkpoint names: stacked experts split per expert (gate_up_proj rows
    are gate then up, as transformers' experts chunk them), rotary buffers dropped."""
    out = {}
    for name, t in state.items():
        if "rotary" in name:
            continue
        if name.endswith("mlp.experts.gate_up_proj"):
            base = prefix + name.removesuffix("gate_up_proj")
            gate_EID, up_EID = t.chunk(2, dim=1)
            for e in range(t.shape[0]):
                out[f"{base}{e}.gate_proj.weight"], out[f"{base}{e}.up_proj.weight"] = gate_EID[e], up_EID[e]
        elif name.endswith("mlp.experts.down_proj"):
            base = prefix + name.removesuffix("down_proj")
            for e in range(t.shape[0]):
                out[f"{base}{e}.down_proj.weight"] = t[e]
        else:
            out[prefix + name] = t
    return {k: v.contiguous() for k, v in out.items()}


@pytest.fixture(scope="module")
def official(tmp_path_factory):
    """(checkpoint tensors by official name, transformers' main model, transformers' MTP decoder layer, anyseek's
    model loaded from the checkpoint folder)."""
    cfg = ModelConfig(**CONFIG)
    hf_config = transformers.DeepseekV3Config(**config_to_hf(cfg))
    hf_config._attn_implementation = "eager"
    g = torch.Generator().manual_seed(0)
    main = transformers.DeepseekV3ForCausalLM(hf_config).eval()
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3DecoderLayer

    layer = DeepseekV3DecoderLayer(hf_config, layer_idx=N).eval()
    _randomize(main, g)
    _randomize(layer, g)
    D = cfg.hidden_size
    ckpt = _official_names(main.state_dict())
    ckpt.update(_official_names(layer.state_dict(), prefix=f"{MTP}."))
    ckpt[f"{MTP}.enorm.weight"] = torch.rand(D, generator=g) + 0.5
    ckpt[f"{MTP}.hnorm.weight"] = torch.rand(D, generator=g) * 2 + 1.0  # unlike enorm's: a swap changes the sums
    ckpt[f"{MTP}.eh_proj.weight"] = torch.randn(D, 2 * D, generator=g) / (2 * D) ** 0.5
    ckpt[f"{MTP}.shared_head.norm.weight"] = torch.rand(D, generator=g) + 0.5
    ckpt[f"{MTP}.embed_tokens.weight"] = ckpt["model.embed_tokens.weight"].clone()
    ckpt[f"{MTP}.shared_head.head.weight"] = ckpt["lm_head.weight"].clone()
    from safetensors.torch import save_file

    folder = tmp_path_factory.mktemp("official")
    save_file(ckpt, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps({**config_to_hf(cfg), "dtype": "float32"}))
    ours = load_pretrained(folder, dtype=torch.float32)
    assert len(ours.mtp) == 1
    return ckpt, main, layer, ours


def _rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


@torch.no_grad()
def reference_mtp_logits(official, ids: list[int], next_ids: list[int]) -> torch.Tensor:
    """One document: MTP module 0's logits [S, V] at every position i, from h^0_i and Emb(next_ids[i])."""
    ckpt, main, layer, _ = official
    ids_1S = torch.tensor([ids])
    S = ids_1S.shape[1]
    h0_1SD = main.model(ids_1S).last_hidden_state  # after the final norm
    emb_1SD = F.embedding(torch.tensor([next_ids]), ckpt[f"{MTP}.embed_tokens.weight"])
    e_1SD, h_1SD = _rms_norm(emb_1SD, ckpt[f"{MTP}.enorm.weight"]), _rms_norm(h0_1SD, ckpt[f"{MTP}.hnorm.weight"])
    x_1SD = torch.cat([e_1SD, h_1SD], dim=-1) @ ckpt[f"{MTP}.eh_proj.weight"].T  # embedding first
    positions = torch.arange(S)[None]
    mask = torch.full((S, S), float("-inf")).triu(1)[None, None]  # causal, added to the scores (eager attention)
    out = layer(x_1SD, attention_mask=mask, position_ids=positions,
                position_embeddings=main.model.rotary_emb(x_1SD, positions))  # fmt: skip
    h1_1SD = out[0] if isinstance(out, tuple) else out
    return (_rms_norm(h1_1SD, ckpt[f"{MTP}.shared_head.norm.weight"]) @ ckpt[f"{MTP}.shared_head.head.weight"].T)[0]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


def test_training_mtp_loss_matches_the_official_layout(official):
    """Two packed documents: the MTP loss (depth 1: the token two ahead, inside each document) equals the
    reference's cross-entropy over the same positions; the main logits equal transformers' on the way."""
    _, main, _, ours = official
    g = torch.Generator().manual_seed(1)
    docs = [torch.randint(0, CONFIG["vocab_size"], (n,), generator=g).tolist() for n in (23, 17)]
    ids = torch.tensor(docs[0] + docs[1])
    targets = torch.tensor(docs[0][1:] + [IGNORE_INDEX] + docs[1][1:] + [IGNORE_INDEX])
    cu = torch.tensor([0, 23, 40], dtype=torch.int32)
    with torch.no_grad():
        out = ours(ids, cu_seqlens=cu, targets=targets)
    total, count = 0.0, 0
    for doc, start in zip(docs, (0, 23)):
        logits = reference_mtp_logits(official, doc, doc[1:] + [0])  # the last position has no next token
        total += F.cross_entropy(logits[:-2], torch.tensor(doc[2:]), reduction="sum")
        count += len(doc) - 2
        with torch.no_grad():
            want = main(torch.tensor([doc])).logits[0]
        assert _rel(out.logits[start : start + len(doc)], want) < 1e-5
    want_loss = total / count
    # fp32 throughout, other summation orders: a few units of roundoff of a loss of ~5.5
    torch.testing.assert_close(out.mtp_loss, want_loss, rtol=1e-5, atol=0)


def test_inference_drafter_matches_the_official_layout(official):
    """The drafter after prefill (h^0 of every prompt position with the next prompt token, the last with the first
    sampled one) and after a two-token extension (over the MTP layer's cached rows) gives the reference's logits at
    each sequence's last position."""
    ours = official[3]
    prompts, first, ext = [[5, 9, 2, 77, 31, 8, 140, 3, 60], [200, 7, 7, 1]], [11, 99], [[42, 17], [250, 0]]
    eng = Engine(ours, max_batch=2, max_len=32, cuda_graphs=False)
    _, h_TD, step = eng.prefill([0, 1], prompts)
    drafts = eng.mtp_prefill(h_TD, step, prompts, first)
    for b, p in enumerate(prompts):
        want = reference_mtp_logits(official, p, p[1:] + [first[b]])[-1]
        assert _rel(drafts[b], want) < 1e-5, b
    # the verification of [first, draft]; the MTP then runs at those two positions with the tokens after them
    tokens = [[f, e[0]] for f, e in zip(first, ext)]
    _, h2_TD = eng.extend([0, 1], tokens)
    drafts = eng.mtp_extend([0, 1], [len(p) for p in prompts], h2_TD, [[e[0], e[1]] for e in ext])
    for b, p in enumerate(prompts):
        seq = p + tokens[b]
        want = reference_mtp_logits(official, seq, seq[1:] + [ext[b][1]])[-1]
        assert _rel(drafts[b], want) < 1e-5, b
