"""Parity with transformers' DeepseekV3ForCausalLM in fp32 on tiny random configs, both directions.

State dicts share names (experts stacked as gate_up_proj / down_proj in both), so the converter only drops our
MTP modules, which transformers does not build.
"""

from __future__ import annotations

import pytest
import torch

from anyseek.hf import config_to_hf
from anyseek.model.config import ModelConfig
from anyseek.model.transformer import DeepSeekV3

transformers = pytest.importorskip("transformers")

BASE = {
    "vocab_size": 256,
    "hidden_size": 64,
    "intermediate_size": 96,
    "moe_intermediate_size": 24,
    "num_hidden_layers": 3,
    "first_k_dense_replace": 1,
    "num_attention_heads": 4,
    "kv_lora_rank": 16,
    "qk_nope_head_dim": 16,
    "qk_rope_head_dim": 8,
    "v_head_dim": 12,
    "n_routed_experts": 8,
    "num_experts_per_tok": 3,
    "n_shared_experts": 1,
    "routed_scaling_factor": 2.5,
    "num_nextn_predict_layers": 1,
    "init_std": 0.08,
}
YARN = {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16, "beta_fast": 32, "beta_slow": 1,
        "mscale": 0.9, "mscale_all_dim": 0.9}  # fmt: skip

CASES = {
    "qlora_groups_yarn_interleave": {"q_lora_rank": 32, "n_group": 4, "topk_group": 2, "rope_scaling": YARN,
                                     "max_position_embeddings": 64, "rope_interleave": True},
    "no_qlora_one_group_halfsplit": {"q_lora_rank": None, "n_group": 1, "topk_group": 1, "rope_interleave": False,
                                     "max_position_embeddings": 64},
    "qlora_groups_yarn_halfsplit": {"q_lora_rank": 32, "n_group": 2, "topk_group": 1, "rope_scaling": YARN,
                                    "max_position_embeddings": 64, "rope_interleave": False, "norm_topk_prob": False},
}  # fmt: skip
SEQ = 40  # > original_max_position_embeddings (16): positions well into the YaRN-extended range


def hf_model(config: ModelConfig):
    hf_config = transformers.DeepseekV3Config(**config_to_hf(config))
    hf_config._attn_implementation = "eager"
    return transformers.DeepseekV3ForCausalLM(hf_config).eval()


def ours_to_hf(state: dict) -> dict:
    return {k: v for k, v in state.items() if not k.startswith("mtp.")}


def randomize_bias(model: torch.nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for name, buf in model.named_buffers():
        if name.endswith("e_score_correction_bias"):
            buf.copy_(torch.randn(buf.shape, generator=g) * 0.1)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


@pytest.mark.parametrize("case", sorted(CASES))
def test_ours_into_transformers(case):
    torch.manual_seed(0)
    config = ModelConfig(**BASE, **CASES[case])
    ours = DeepSeekV3(config).eval()
    with torch.no_grad():
        randomize_bias(ours, 1)
    theirs = hf_model(config)
    missing, unexpected = theirs.load_state_dict(ours_to_hf(ours.state_dict()), strict=False)
    assert not unexpected and not [k for k in missing if "rotary" not in k], (missing, unexpected)
    ids = torch.randint(0, config.vocab_size, (2, SEQ))
    with torch.no_grad():
        a = ours(ids).logits
        b = theirs(ids).logits
    err = rel_err(a, b)
    print(f"{case}: ours->transformers max rel err {err:.2e}")
    assert err < 1e-5


@pytest.mark.parametrize("case", sorted(CASES))
def test_transformers_into_ours(case):
    torch.manual_seed(1)
    config = ModelConfig(**{**BASE, "num_nextn_predict_layers": 0}, **CASES[case])
    theirs = hf_model(config)
    with torch.no_grad():
        for p in theirs.parameters():  # transformers initialises with std 0.02 and zero experts on CPU; be bolder
            p.normal_(0, 0.08) if p.dim() > 1 else p.uniform_(0.5, 1.5)
        randomize_bias(theirs, 2)
    ours = DeepSeekV3(config).eval()
    ours.load_state_dict({k: v for k, v in theirs.state_dict().items() if "rotary" not in k})
    # a packed batch of two documents against two separate rows in transformers
    ids = torch.randint(0, config.vocab_size, (2, SEQ))
    cu = torch.tensor([0, SEQ, 2 * SEQ], dtype=torch.int32)
    with torch.no_grad():
        a = ours(ids.reshape(-1), cu_seqlens=cu).logits.view(2, SEQ, -1)
        b = theirs(ids).logits
    err = rel_err(a, b)
    print(f"{case}: transformers->ours max rel err {err:.2e}")
    assert err < 1e-5


def test_routing_matches_transformers():
    """Same experts chosen and same weights as transformers' router, with groups and a routing bias."""
    torch.manual_seed(3)
    config = ModelConfig(**BASE, **CASES["qlora_groups_yarn_interleave"])
    ours = DeepSeekV3(config).eval()
    with torch.no_grad():
        randomize_bias(ours, 4)
    theirs = hf_model(config)
    theirs.load_state_dict(ours_to_hf(ours.state_dict()), strict=False)
    x = torch.randn(50, config.hidden_size)
    _, ids, w = ours.model.layers[1].mlp.gate(x)
    _, w_hf, ids_hf = theirs.model.layers[1].mlp.gate(x)
    o, o_hf = ids.sort(dim=-1), ids_hf.sort(dim=-1)
    assert torch.equal(o.values, o_hf.values)
    torch.testing.assert_close(w.gather(1, o.indices), w_hf.gather(1, o_hf.indices))
