"""ModelConfig: flavors, config.json round trips (ours and transformers'), validation errors that name the field."""

from __future__ import annotations

import json

import pytest
import torch

from anyseek.hf import config_from_hf, config_to_hf, read_config_json
from anyseek.model.config import ModelConfig
from anyseek.model.flavors import FLAVORS
from anyseek.model.transformer import DeepSeekV3


@pytest.mark.parametrize("name", sorted(FLAVORS))
def test_flavors_build_on_meta(name):
    model = DeepSeekV3(ModelConfig.from_name(name), device="meta")
    assert all(p.is_meta for p in model.parameters())
    assert model.num_parameters(active_only=True) < model.num_parameters()


def test_tiny_has_every_feature_and_fits():
    c = ModelConfig.from_name("tiny")
    model = DeepSeekV3(c)
    assert 0.5e6 <= model.num_parameters() <= 2e6
    assert c.q_lora_rank and c.n_group >= 2 and c.n_moe_layers >= 2 and c.num_nextn_predict_layers == 1
    assert c.vocab_size == 4096
    stds = [model.model.embed_tokens.weight.std(), model.model.layers[1].mlp.experts.gate_up_proj.std()]
    assert all(abs(s.item() - 0.006) < 3e-4 for s in stds)


def test_671b_matches_published_size():
    model = DeepSeekV3(ModelConfig.from_name("671B"), device="meta")
    # 671B main model + 14B MTP module (DeepSeek-V3 report), 37B activated
    assert 680e9 < model.num_parameters() < 690e9
    assert 37e9 < model.num_parameters(active_only=True) < 39.5e9
    assert model.config.softmax_scale == pytest.approx(
        192**-0.5 * (0.1 * torch.log(torch.tensor(40.0)).item() + 1) ** 2
    )


def test_small_matches_baselines():
    model = DeepSeekV3(ModelConfig.from_name("small"), device="meta")
    assert round(model.num_parameters() / 1e6) == 486  # shared/BASELINES.md: 486M parameters


def test_flops_per_token_counts_active_weights_and_attention():
    model = DeepSeekV3(ModelConfig.from_name("tiny"), device="meta")
    f1, f2 = model.flops_per_token(100), model.flops_per_token(200)
    c = model.config
    assert f2 - f1 == pytest.approx(3 * (c.num_hidden_layers + 1) * c.num_attention_heads * (48 + 32) * 100)
    assert f1 > 6 * (model.num_parameters(active_only=True) - c.vocab_size * c.hidden_size)


@pytest.mark.parametrize("name", sorted(FLAVORS))
def test_hf_dict_round_trip(name):
    c = ModelConfig.from_name(name)
    assert config_from_hf(config_to_hf(c)) == c
    assert config_to_hf(c)["model_type"] == "deepseek_v3"


@pytest.mark.parametrize("name", ["tiny", "671B"])
def test_round_trip_through_transformers_config(name, tmp_path):
    transformers = pytest.importorskip("transformers")
    c = ModelConfig.from_name(name)
    hf = transformers.DeepseekV3Config(**config_to_hf(c))
    hf.save_pretrained(tmp_path)
    back = read_config_json(tmp_path / "config.json")
    assert back == c


def test_both_rope_spellings():
    yarn = {"factor": 40.0, "original_max_position_embeddings": 4096, "mscale": 1.0, "mscale_all_dim": 1.0}
    old = config_from_hf({"rope_theta": 500.0, "rope_scaling": {"type": "yarn", **yarn}})
    new = config_from_hf({"rope_parameters": {"rope_type": "yarn", "rope_theta": 500.0, **yarn}})
    assert old == new and old.rope_theta == 500.0 and old.rope_scaling["factor"] == 40.0
    plain = config_from_hf({"rope_parameters": {"rope_type": "default", "rope_theta": 7.0}})
    assert plain.rope_scaling is None and plain.rope_theta == 7.0


def test_official_spellings_accepted():
    c = config_from_hf({"q_lora_rank": 0, "num_mtp_layers": 2, "topk_method": "noaux_tc", "seq_aux": True})
    assert c.q_lora_rank is None and c.num_nextn_predict_layers == 2
    assert config_from_hf({"model_type": "deepseek_v2"}).num_nextn_predict_layers == 0  # silent: no MTP


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"n_routed_experts": 7, "n_group": 2}, r"n_routed_experts \(7\) must be divisible by n_group \(2\)"),
        ({"topk_group": 9}, r"topk_group \(9\) must be between 1 and n_group \(8\)"),
        ({"num_experts_per_tok": 200, "topk_group": 4}, r"num_experts_per_tok \(200\)"),
        ({"n_routed_experts": 8, "n_group": 8, "topk_group": 2, "num_experts_per_tok": 2}, "fewer than 2 experts"),
        ({"first_k_dense_replace": 70}, r"first_k_dense_replace \(70\) must be <= num_hidden_layers \(61\)"),
        ({"qk_rope_head_dim": 63}, "qk_rope_head_dim must be even"),
        ({"hidden_size": 0}, "hidden_size must be a positive integer"),
        ({"scoring_func": "relu"}, "scoring_func must be"),
        ({"rope_scaling": {"type": "linear", "factor": 2.0}}, "'linear' is not supported"),
        ({"rope_scaling": {"type": "yarn", "factor": 2.0}}, "needs original_max_position_embeddings"),
        ({"rope_scaling": {"type": "yarn", "factr": 2.0}}, "unknown key.*factr"),
    ],
)
def test_bad_fields_are_named(fields, message):
    with pytest.raises(ValueError, match=message):
        ModelConfig(**fields)


def test_bad_config_json_is_named(tmp_path):
    good = config_to_hf(ModelConfig.from_name("tiny"))
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**good, "moe_frobnication": 3}))
    with pytest.raises(ValueError, match=r"config\.json: unknown config key\(s\): moe_frobnication"):
        read_config_json(path)
    path.write_text(json.dumps({**good, "hidden_act": "gelu"}))
    with pytest.raises(ValueError, match="hidden_act='gelu' is not supported"):
        read_config_json(path)
    path.write_text(json.dumps({**good, "num_key_value_heads": 1}))
    with pytest.raises(ValueError, match=r"num_key_value_heads \(1\) must equal num_attention_heads \(4\)"):
        read_config_json(path)
    path.write_text(json.dumps({**good, "n_group": 3}))
    with pytest.raises(ValueError, match=r"config\.json: n_routed_experts \(8\) must be divisible by n_group \(3\)"):
        read_config_json(path)
    path.write_text('{"hidden_size": 64,\n "vocab_size": }')
    with pytest.raises(ValueError, match="not valid JSON \\(line 2"):
        read_config_json(path)
    with pytest.raises(ValueError, match="unknown model flavor 'huge'"):
        ModelConfig.from_name("huge")


# deepseek-ai/DeepSeek-V3 config.json as published (keys and values; quantization_config abridged)
OFFICIAL_V3 = {
    "architectures": ["DeepseekV3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "auto_map": {"AutoConfig": "configuration_deepseek.DeepseekV3Config"}, "aux_loss_alpha": 0.001,
    "bos_token_id": 0, "eos_token_id": 1, "ep_size": 1, "first_k_dense_replace": 3, "hidden_act": "silu",
    "hidden_size": 7168, "initializer_range": 0.02, "intermediate_size": 18432, "kv_lora_rank": 512,
    "max_position_embeddings": 163840, "model_type": "deepseek_v3", "moe_intermediate_size": 2048,
    "moe_layer_freq": 1, "n_group": 8, "n_routed_experts": 256, "n_shared_experts": 1, "norm_topk_prob": True,
    "num_attention_heads": 128, "num_experts_per_tok": 8, "num_hidden_layers": 61, "num_key_value_heads": 128,
    "num_nextn_predict_layers": 1, "pretraining_tp": 1, "q_lora_rank": 1536, "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64, "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3",
    "quant_method": "fp8", "weight_block_size": [128, 128]}, "rms_norm_eps": 1e-06,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
    "original_max_position_embeddings": 4096, "type": "yarn"}, "rope_theta": 10000, "routed_scaling_factor": 2.5,
    "scoring_func": "sigmoid", "seq_aux": True, "tie_word_embeddings": False, "topk_group": 4,
    "topk_method": "noaux_tc", "torch_dtype": "bfloat16", "transformers_version": "4.33.1", "use_cache": True,
    "v_head_dim": 128, "vocab_size": 129280,
}  # fmt: skip


def test_official_v3_config_is_the_671b_flavor():
    with pytest.warns(UserWarning, match=r"ignoring aux_loss_alpha=0\.001 \(a DeepSeek-V2 leftover"):
        c = config_from_hf(OFFICIAL_V3)
    # the official file's aux_loss_alpha (0.001, V2's) must not set our balance-loss weight: the report's 1e-4 stays
    assert c == ModelConfig.from_name("671B")
    assert c.aux_loss_alpha == 1e-4
    assert c.extra == {"bos_token_id": 0, "eos_token_id": 1}


def test_v2_config_keeps_its_aux_loss_alpha_and_our_knobs_round_trip():
    v2 = config_from_hf({"model_type": "deepseek_v2", "scoring_func": "softmax", "aux_loss_alpha": 0.003,
                         "n_group": 1, "topk_group": 1})
    assert v2.aux_loss_alpha == 0.003
    custom = ModelConfig.from_name("tiny", aux_loss_alpha=5e-4, mtp_loss_weight=0.1, bias_update_speed=0.0)
    d = config_to_hf(custom)
    assert "aux_loss_alpha" not in d and d["anyseek"]["aux_loss_alpha"] == 5e-4  # under our own key, never V2's
    assert config_from_hf(d) == custom


@pytest.mark.parametrize(
    "fields",
    [{"n_routed_experts": 0}, {"n_shared_experts": 0}, {"num_nextn_predict_layers": 0, "tie_word_embeddings": True}],
)
def test_edge_configs_run(fields):
    c = ModelConfig.from_name("tiny", **fields)
    model = DeepSeekV3(c)
    out = model(torch.randint(0, 4096, (2, 6)), targets=torch.randint(0, 4096, (2, 6)))
    assert torch.isfinite(out.loss)
    if not c.n_routed_experts:
        assert out.expert_load is None and out.balance_loss is None
    if c.tie_word_embeddings:
        assert model.lm_head.weight is model.model.embed_tokens.weight


def test_meta_then_materialise():
    model = DeepSeekV3(ModelConfig.from_name("tiny"), device="meta", dtype=torch.bfloat16)
    assert all(m.gate.e_score_correction_bias.dtype == torch.float32 for m in model.moe_layers())
    model.to_empty(device="cpu")
    model.init_weights()
    assert all(m.gate.e_score_correction_bias.abs().sum() == 0 for m in model.moe_layers())
    assert model.model.norm.weight.dtype == torch.bfloat16 and (model.model.norm.weight == 1).all()
    out = model(torch.randint(0, 4096, (1, 8)), targets=torch.randint(0, 4096, (1, 8)))
    assert torch.isfinite(out.loss)


# moonshotai/Moonlight-16B-A3B config.json (architecture keys)
MOONLIGHT = {
    "aux_loss_alpha": 0.001, "first_k_dense_replace": 1, "hidden_act": "silu", "hidden_size": 2048,
    "intermediate_size": 11264, "kv_lora_rank": 512, "max_position_embeddings": 8192, "model_type": "deepseek_v3",
    "moe_intermediate_size": 1408, "moe_layer_freq": 1, "n_group": 1, "n_routed_experts": 64, "n_shared_experts": 2,
    "norm_topk_prob": True, "num_attention_heads": 16, "num_experts_per_tok": 6, "num_hidden_layers": 27,
    "num_key_value_heads": 16, "num_nextn_predict_layers": 0, "q_lora_rank": None, "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64, "rms_norm_eps": 1e-05, "rope_theta": 50000.0, "routed_scaling_factor": 2.446,
    "scoring_func": "sigmoid", "seq_aux": True, "tie_word_embeddings": False, "topk_group": 1,
    "topk_method": "noaux_tc", "v_head_dim": 128, "vocab_size": 163840,
}  # fmt: skip


def test_moonlight_config_is_the_16b_flavor():
    with pytest.warns(UserWarning, match="ignoring aux_loss_alpha=0.001"):
        moonlight = config_from_hf(MOONLIGHT)
    assert moonlight == ModelConfig.from_name("16B")  # its aux_loss_alpha (a V2 leftover) is ignored
