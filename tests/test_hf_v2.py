"""Softmax-routed (DeepSeek-V2-style) models and transformers' DeepseekV2, fp32 on CPU.

Written as `model_type: deepseek_v2` (transformers' DeepseekV3 always routes with sigmoid): our save -> transformers
gives our logits, for greedy and group-limited routing; transformers' save -> our load gives its logits. A trained
routing bias (which DeepseekV2 lacks), norm_topk_prob and rope_interleave=False are refused by exports and kept,
with a warning and a note, by training checkpoints, which load back exactly. Real DeepSeek-V2 configs read as before.
"""

from __future__ import annotations

import json
import warnings

import pytest
import torch
from helpers import TINY, assert_logits_close, hf_load, our_logits, run, tiny_cfg, tiny_model, token_ids

from anyseek import hf
from anyseek.hf.config import config_from_hf, config_to_hf
from anyseek.hf.safetensors_io import scan_folder
from anyseek.model.config import ModelConfig
from anyseek.storage import CheckpointError

transformers = pytest.importorskip("transformers")

# n_group 4 / topk_group 1 with 2 experts per token: group-limited routing differs from greedy on these inputs
ROUTINGS = {"greedy": {"n_group": 1, "topk_group": 1}, "group_limited_greedy": {"n_group": 4, "topk_group": 1}}
YARN = {"factor": 4.0, "original_max_position_embeddings": 8, "mscale": 0.707, "mscale_all_dim": 0.707}
# a softmax model transformers' DeepseekV2 computes: no renormalisation, a scale it must apply, V2-Lite's YaRN
V2 = {"scoring_func": "softmax", "norm_topk_prob": False, "routed_scaling_factor": 1.7, "max_position_embeddings": 32,
      "rope_scaling": {"type": "yarn", **YARN}}


def v2_model(seed: int = 0, bias: float = 0.0, **overrides):
    """A tiny softmax-routed model; routing biases N(0, bias) (zero by default, as a fresh V2 model has)."""
    model = tiny_model(seed, **{**V2, **ROUTINGS["greedy"], **overrides})
    with torch.no_grad():
        for moe in model.moe_layers():
            b = moe.gate.e_score_correction_bias
            b.normal_(0, bias) if bias else b.zero_()
    return model


@pytest.mark.parametrize("method", ROUTINGS)
def test_save_then_transformers_deepseek_v2_same_logits(tmp_path, method):
    # like V2-Lite (greedy, no q LoRA) and V2 (group-limited, q LoRA)
    model = v2_model(**ROUTINGS[method], q_lora_rank=None if method == "greedy" else 32)
    hf.save_pretrained(model, tmp_path / "ours")
    cfg = json.loads((tmp_path / "ours" / "config.json").read_text())
    assert cfg["model_type"] == "deepseek_v2" and cfg["architectures"] == ["DeepseekV2ForCausalLM"]
    assert cfg["topk_method"] == method
    ref, info = hf_load(tmp_path / "ours")
    assert type(ref).__name__ == "DeepseekV2ForCausalLM"
    assert not info["missing_keys"] and not info["mismatched_keys"]
    # nothing but the MTP module (layer 3) is left over: the all-zero routing bias is not written
    assert info["unexpected_keys"] and all(k.startswith("model.layers.3.") for k in info["unexpected_keys"])
    x = token_ids()
    assert_logits_close(our_logits(model, x), ref(x).logits.detach())


@pytest.mark.parametrize("fused", [False, True], ids=["per-expert", "fused"])
@pytest.mark.parametrize("method", ROUTINGS)
def test_transformers_deepseek_v2_save_then_our_load_same_logits(tmp_path, method, fused):
    """transformers' DeepseekV2Config has no scoring_func: the folder's model_type says softmax."""
    torch.manual_seed(0)
    kw = {k: v for k, v in TINY.items() if k not in ("init_std", "num_nextn_predict_layers")}
    rope = {"rope_type": "yarn", "rope_theta": 10000.0, **YARN}
    hf_cfg = transformers.DeepseekV2Config(**{**kw, **ROUTINGS[method]}, topk_method=method, routed_scaling_factor=1.7,
                                           max_position_embeddings=32, rope_parameters=rope, initializer_range=0.1)
    ref = transformers.AutoModelForCausalLM.from_config(hf_cfg).eval()
    ref.save_pretrained(tmp_path / "theirs", save_original_format=not fused)
    assert "scoring_func" not in json.loads((tmp_path / "theirs" / "config.json").read_text())
    model = hf.load_pretrained(tmp_path / "theirs", dtype=torch.float32)
    assert model.config.scoring_func == "softmax" and not model.config.norm_topk_prob
    assert (model.config.n_group, model.config.topk_group) == (ROUTINGS[method]["n_group"], 1)
    x = token_ids(2)
    assert_logits_close(our_logits(model, x), ref(x).logits.detach())


def test_round_trip_is_exact_and_keeps_our_knobs(tmp_path):
    model = v2_model(3, q_lora_rank=None, aux_loss_alpha=3e-3, bias_update_speed=0.0, mtp_loss_weight=0.2,
                     **ROUTINGS["group_limited_greedy"])
    with warnings.catch_warnings():  # a zero routing bias exports silently
        warnings.simplefilter("error")
        hf.save_pretrained(model, tmp_path / "v2")
    assert not any("e_score_correction_bias" in n for n in scan_folder(tmp_path / "v2"))
    loaded = hf.load_pretrained(tmp_path / "v2", dtype=torch.float32)
    assert loaded.config == model.config and loaded.config.aux_loss_alpha == 3e-3
    for (name, a), b in zip(model.state_dict().items(), loaded.state_dict().values()):
        assert torch.equal(a, b), name


@pytest.mark.parametrize(
    ("overrides", "bias", "reason"),
    [
        ({}, 0.05, r"trained routing bias \(e_score_correction_bias nonzero in 3 MoE layers"),
        ({"norm_topk_prob": True}, 0.0, r"norm_topk_prob=True"),
        ({"rope_interleave": False}, 0.0, r"rope_interleave=False"),
    ],
    ids=["bias", "norm_topk_prob", "rope_layout"],
)
def test_export_refuses_what_transformers_would_compute_differently(tmp_path, overrides, bias, reason):
    out = tmp_path / "out"
    hf.save_pretrained(v2_model(3), out)  # an earlier model that save_pretrained may replace
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    with pytest.raises(CheckpointError, match=reason):
        hf.save_pretrained(v2_model(4, bias=bias, **overrides), out)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before  # refused before anything was written


def test_checkpoint_keeps_trained_bias_with_a_note_and_loads_exactly(tmp_path):
    """A training checkpoint's files (for_transformers=False): written as deepseek_v2, the bias kept under its name
    for anyseek; transformers loads the folder, reports the bias unexpected and computes another model."""
    model = v2_model(5, bias=0.05)
    (tmp_path / "ckpt").mkdir()
    with pytest.warns(UserWarning, match="transformers' DeepseekV2, which will load it and compute another model"):
        hf.write_model_files(model, tmp_path / "ckpt", for_transformers=False)
    cfg = json.loads((tmp_path / "ckpt" / "config.json").read_text())
    assert cfg["model_type"] == "deepseek_v2" and "trained routing bias" in cfg["anyseek"]["note"]
    loaded = hf.load_pretrained(tmp_path / "ckpt", dtype=torch.float32)
    assert loaded.config == model.config
    for (name, a), b in zip(model.state_dict().items(), loaded.state_dict().values()):
        assert torch.equal(a, b), name
    ref, info = hf_load(tmp_path / "ckpt")
    assert "model.layers.1.mlp.gate.e_score_correction_bias" in info["unexpected_keys"]
    x = token_ids(5)
    assert not torch.allclose(our_logits(model, x), ref(x).logits.detach(), rtol=0, atol=1e-3)


def test_training_run_checkpoints_a_biased_v2_model_that_export_refuses(data_dir, tmp_path, capsys):
    """A softmax run whose routing bias trains: its step-N (the resume state) is written (deepseek_v2, bias kept),
    `anyseek export` says why it will not write it; with bias_update_speed 0 the export loads in transformers."""
    from anyseek.cli import main

    softmax = ["--model.scoring_func=softmax", "--model.norm_topk_prob=false", "--model.n_group=1",
               "--model.topk_group=1", "--train.max_steps=1"]
    with pytest.warns(UserWarning, match="trained routing bias"):
        run(tiny_cfg(data_dir, *softmax), tmp_path / "biased")
    step = tmp_path / "biased" / "step-1"
    assert json.loads((step / "config.json").read_text())["model_type"] == "deepseek_v2"
    assert hf.load_pretrained(step).model.layers[1].mlp.gate.e_score_correction_bias.any()
    capsys.readouterr()  # the run's progress line
    assert main(["export", str(step), "--out", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: not written: transformers' DeepseekV2") and "trained routing bias" in err
    assert err.count("\n") == 1 and not (tmp_path / "x").exists()

    run(tiny_cfg(data_dir, *softmax, "--model.bias_update_speed=0"), tmp_path / "plain")
    assert main(["export", str(tmp_path / "plain"), "--out", str(tmp_path / "y")]) == 0
    ours, (ref, _) = hf.load_pretrained(tmp_path / "y"), hf_load(tmp_path / "y")
    x = torch.randint(0, ours.config.vocab_size, (1, 9), generator=torch.Generator().manual_seed(0))
    assert_logits_close(our_logits(ours, x), ref(x).logits.detach())


def test_generate_and_eval_load_a_deepseek_v2_folder(tmp_path):
    from anyseek.infer.loading import load_model

    model = v2_model(6)
    hf.save_pretrained(model, tmp_path / "v2")
    loaded = load_model(tmp_path / "v2", device="cpu")
    x = token_ids(6)
    assert_logits_close(our_logits(loaded, x), our_logits(model, x), rel=0)


# deepseek-ai/DeepSeek-V2-Lite and DeepSeek-V2 config.json (routing and shape keys)
V2_LITE = {
    "architectures": ["DeepseekV2ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "aux_loss_alpha": 0.001, "bos_token_id": 100000, "eos_token_id": 100001, "first_k_dense_replace": 1,
    "hidden_act": "silu", "hidden_size": 2048, "initializer_range": 0.02, "intermediate_size": 10944,
    "kv_lora_rank": 512, "max_position_embeddings": 163840, "model_type": "deepseek_v2",
    "moe_intermediate_size": 1408, "moe_layer_freq": 1, "n_group": 1, "n_routed_experts": 64, "n_shared_experts": 2,
    "norm_topk_prob": False, "num_attention_heads": 16, "num_experts_per_tok": 6, "num_hidden_layers": 27,
    "num_key_value_heads": 16, "pretraining_tp": 1, "q_lora_rank": None, "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64, "rms_norm_eps": 1e-06, "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40,
    "mscale": 0.707, "mscale_all_dim": 0.707, "original_max_position_embeddings": 4096, "type": "yarn"},
    "rope_theta": 10000, "routed_scaling_factor": 1.0, "scoring_func": "softmax", "seq_aux": True,
    "tie_word_embeddings": False, "topk_group": 1, "topk_method": "greedy", "torch_dtype": "bfloat16",
    "use_cache": True, "v_head_dim": 128, "vocab_size": 102400,
}  # fmt: skip
V2_FULL = {**V2_LITE, "hidden_size": 5120, "intermediate_size": 12288, "moe_intermediate_size": 1536,
           "n_group": 8, "topk_group": 3, "topk_method": "group_limited_greedy", "n_routed_experts": 160,
           "num_attention_heads": 128, "num_key_value_heads": 128, "num_hidden_layers": 60, "q_lora_rank": 1536,
           "routed_scaling_factor": 16.0, "vocab_size": 102400}  # fmt: skip


@pytest.mark.parametrize("official", [V2_LITE, V2_FULL], ids=["V2-Lite", "V2"])
def test_official_v2_configs_read_as_written_and_round_trip(official):
    c = config_from_hf(official)
    want = {k: official[k] for k in ("n_group", "topk_group", "routed_scaling_factor", "num_experts_per_tok",
                                     "first_k_dense_replace", "n_shared_experts", "aux_loss_alpha")}
    assert {k: getattr(c, k) for k in want} == want
    assert c.scoring_func == "softmax" and not c.norm_topk_prob and c.num_nextn_predict_layers == 0
    d = config_to_hf(c)
    assert (d["model_type"], d["topk_method"]) == ("deepseek_v2", official["topk_method"])
    assert config_from_hf(d) == c


def test_v2_config_routing_as_transformers_reads_it():
    tiny = {k: v for k, v in TINY.items() if k != "init_std"}
    # silent keys mean DeepseekV2Config's defaults, not ours (V3's)
    c = config_from_hf({**tiny, "model_type": "deepseek_v2", "n_shared_experts": 1, "first_k_dense_replace": 1})
    assert (c.scoring_func, c.routed_scaling_factor, c.norm_topk_prob) == ("softmax", 1.0, False)
    # "greedy" (the default) ignores groups, as transformers' router does
    assert (c.n_group, c.topk_group) == (1, 1)
    assert config_from_hf({**tiny, "model_type": "deepseek_v2", "topk_method": "group_limited_greedy"}).n_group == 2
    with pytest.raises(ValueError, match=r"scoring_func='sigmoid' with model_type 'deepseek_v2'"):
        config_from_hf({**tiny, "model_type": "deepseek_v2", "scoring_func": "sigmoid"})
    with pytest.raises(ValueError, match=r"topk_method 'noaux_tc' is not a DeepSeek-V2 routing"):
        config_from_hf({**tiny, "model_type": "deepseek_v2", "topk_method": "noaux_tc"})
    with pytest.raises(ValueError, match=r"mlp_bias=True is not supported"):
        config_from_hf({**tiny, "model_type": "deepseek_v2", "mlp_bias": True})
    # the sigmoid path is unchanged; old anyseek folders (softmax written as deepseek_v3) still read as softmax
    assert config_to_hf(ModelConfig(**tiny))["model_type"] == "deepseek_v3"
    old = config_from_hf({**tiny, "model_type": "deepseek_v3", "scoring_func": "softmax", "topk_method": "greedy"})
    assert (old.scoring_func, old.n_group) == ("softmax", 2)
