"""config.json <-> ModelConfig.

    cfg = read_config_json(Path("folder/config.json"))
    d = config_to_hf(cfg)          # what transformers' DeepseekV3Config / DeepseekV2Config (and we) read back

Sigmoid-routed models are written as `model_type: deepseek_v3`, softmax-routed ones as `deepseek_v2`: transformers'
DeepseekV3 always routes with sigmoid scores, its DeepseekV2 always with softmax (`topk_method` greedy or
group_limited_greedy, group score = the max). `transformers_gaps` names what transformers' DeepseekV2 cannot compute
(it has no routing bias, never renormalises the top-k weights, rotates interleaved pairs only): `anyseek.hf`'s
writer refuses such models for exports and writes them, with a warning, for training checkpoints.
Unknown keys are an error that names the key and the file. RoPE scaling is read in both spellings
(`rope_scaling` + `rope_theta`, and transformers 5's `rope_parameters`). anyseek's training knobs (balance-loss
weight, bias update speed, MTP weight, init std) are written under the key `anyseek`, so a config.json from
elsewhere can never set them by accident: see `V3_IGNORED_TRAINING_KEYS`.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import warnings
from pathlib import Path

from anyseek.model.config import ROPE_KEYS, TRAINING_KNOBS, ModelConfig

# anyseek's own training knobs: written under "anyseek" in config.json
NOTE_KEY = "note"  # "anyseek": {"note": ...}: for people reading the file (what transformers will not compute); unread
# Keys DeepSeek-V3 configs carry as leftovers of V2 that would silently set a training knob: the official V3
# config.json has aux_loss_alpha = 0.001 (V2's value), ten times the 1e-4 of the V3 report. Ignored (with a warning)
# for V3 models; set `model.aux_loss_alpha` in the run config to choose another weight explicitly.
V3_IGNORED_TRAINING_KEYS = ("aux_loss_alpha",)
V3_MODEL_TYPES = ("deepseek_v3", "kimi_k2")
V2_MODEL_TYPE = "deepseek_v2"
V2_TOPK_METHODS = ("greedy", "group_limited_greedy")  # what transformers' DeepseekV2 router implements
# What a deepseek_v2 config.json silent about these keys means (transformers' DeepseekV2Config defaults, and the
# official V2 code's scoring), where our defaults (DeepSeek-V3's) differ
V2_DEFAULTS = {"scoring_func": "softmax", "routed_scaling_factor": 1.0, "norm_topk_prob": False,
               "first_k_dense_replace": 0, "n_shared_experts": 2}  # fmt: skip
# Keys a Hugging Face / official config.json may carry that do not change the model we build.
# (Some are checked for values we cannot honour, see _check_hf_only.)
IGNORED_HF_KEYS = frozenset(
    {
        "_name_or_path", "architectures", "auto_map", "model_type", "torch_dtype", "dtype", "transformers_version",
        "bos_token_id", "eos_token_id", "pad_token_id", "attention_bias", "attention_dropout", "hidden_act",
        "initializer_range", "use_cache", "ep_size", "moe_layer_freq", "topk_method", "quantization_config",
        "pretraining_tp", "head_dim", "qk_head_dim", "num_key_value_heads", "seq_aux", "output_router_logits",
        "router_aux_loss_coef", "return_dict", "output_hidden_states", "output_attentions", "torchscript",
        "chunk_size_feed_forward", "is_encoder_decoder", "id2label", "label2id", "problem_type", "num_mtp_layers",
        "tokenizer_class", "use_return_dict", "tie_encoder_decoder", "is_decoder", "add_cross_attention",
        "cross_attention_hidden_size", "prefix", "sep_token_id", "decoder_start_token_id", "task_specific_params",
        "finetuning_task", "tf_legacy_loss", "use_bfloat16", "max_length", "generation_config", "mlp_bias",
    }
)  # fmt: skip
TOKEN_ID_KEYS = ("bos_token_id", "eos_token_id", "pad_token_id")


def config_from_hf(d: dict, source: str = "config") -> ModelConfig:
    """A ModelConfig from a Hugging Face / official config.json dict. Unknown keys are an error naming the key."""
    d = dict(d)
    _check_hf_only(d, source)
    if d.get("model_type") == V2_MODEL_TYPE:
        d = _v2_routing(d, source)
    knobs = d.pop("anyseek", None) or {}
    if not isinstance(knobs, dict) or set(knobs) - {*TRAINING_KNOBS, NOTE_KEY}:
        raise ValueError(f"{source}: key 'anyseek' must map some of {', '.join(TRAINING_KNOBS)} to numbers")
    knobs = {k: v for k, v in knobs.items() if k != NOTE_KEY}
    own = {f.name for f in dataclasses.fields(ModelConfig)} - {"extra"}
    if d.get("model_type", "deepseek_v3") in V3_MODEL_TYPES:
        for key in V3_IGNORED_TRAINING_KEYS:
            if key in d and key not in knobs:
                warnings.warn(
                    f"{source}: ignoring {key}={d[key]} (a DeepSeek-V2 leftover in V3 configs; the V3 report uses "
                    f"{getattr(ModelConfig, key)}); set model.{key} in the run config to choose it explicitly",
                    stacklevel=2,
                )
            d.pop(key, None)
    kwargs = {k: v for k, v in d.items() if k in own}
    kwargs.update(knobs)
    if "num_nextn_predict_layers" not in d:  # a config.json silent about MTP ships no MTP weights (V2, Moonlight)
        kwargs["num_nextn_predict_layers"] = d.get("num_mtp_layers", 0)
    rope_params = d.get("rope_parameters")
    if rope_params is not None:
        unknown = set(rope_params) - ROPE_KEYS
        if unknown:
            raise ValueError(f"{source}: unknown key(s) in rope_parameters: {', '.join(sorted(unknown))}")
        rope_params = dict(rope_params)
        if "rope_theta" in rope_params:
            kwargs["rope_theta"] = rope_params.pop("rope_theta")
        if rope_params.get("rope_type", rope_params.get("type", "default")) != "default":
            kwargs["rope_scaling"] = rope_params
    unknown = sorted(set(d) - own - IGNORED_HF_KEYS - {"rope_parameters"})
    if unknown:
        raise ValueError(f"{source}: unknown config key(s): {', '.join(unknown)}")
    kwargs["extra"] = {k: d[k] for k in TOKEN_ID_KEYS if k in d}
    try:
        return ModelConfig(**kwargs)
    except ValueError as e:
        raise ValueError(f"{source}: {e}") from None


def config_to_hf(cfg: ModelConfig) -> dict:
    """A config.json dict that transformers (DeepseekV3Config for sigmoid routing, DeepseekV2Config for softmax) and
    `config_from_hf` read back. Every ModelConfig field is written (transformers keeps the ones it does not use)."""
    skip = {"extra", *TRAINING_KNOBS}
    d = copy.deepcopy({f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg) if f.name not in skip})
    rope = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    if cfg.rope_scaling is not None:
        rope = {**cfg.rope_scaling, "rope_theta": cfg.rope_theta}
    d["rope_parameters"] = rope  # transformers >= 5; rope_theta / rope_scaling stay for 4.x and the official code
    if cfg.scoring_func == "softmax":  # transformers' DeepseekV3 would route with sigmoid: its DeepseekV2 is ours
        # "greedy" ignores n_group / topk_group: written only where they are 1
        model_type, arch = V2_MODEL_TYPE, "DeepseekV2ForCausalLM"
        topk_method = "greedy" if cfg.n_group == 1 else "group_limited_greedy"
    else:
        model_type, arch, topk_method = "deepseek_v3", "DeepseekV3ForCausalLM", "noaux_tc"
    d.update(
        model_type=model_type,
        architectures=[arch],
        num_key_value_heads=cfg.num_attention_heads,
        hidden_act="silu",
        attention_bias=False,
        topk_method=topk_method,
        anyseek={k: getattr(cfg, k) for k in TRAINING_KNOBS},
    )
    d.update(copy.deepcopy(cfg.extra))
    return d


def transformers_gaps(cfg: ModelConfig) -> list[str]:
    """What of `cfg` the transformers class its config.json names would not compute (empty: nothing). Only softmax
    routing (DeepseekV2) has gaps; the model's state adds one (a trained routing bias, see hf/pretrained.py)."""
    if cfg.scoring_func != "softmax":
        return []
    gaps = []
    if cfg.norm_topk_prob:
        gaps.append("norm_topk_prob=True (transformers' DeepseekV2 never renormalises the top-k routing weights)")
    if not cfg.rope_interleave:
        gaps.append("rope_interleave=False (transformers' DeepseekV2 rotates interleaved pairs only)")
    return gaps


def read_config_json(path: str | Path) -> ModelConfig:
    """A config.json (Hugging Face format); errors name the file."""
    path = Path(path)
    try:
        d = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON (line {e.lineno}: {e.msg})") from None
    if not isinstance(d, dict):
        raise ValueError(f"{path}: expected a JSON object at the top level")  # noqa: TRY004
    return config_from_hf(d, source=str(path))


def write_config_json(cfg: ModelConfig, path: str | Path) -> None:
    Path(path).write_text(json.dumps(config_to_hf(cfg), indent=2, sort_keys=True) + "\n")


def _v2_routing(d: dict, source: str) -> dict:
    """A deepseek_v2 config.json's routing in our fields: its defaults (V2_DEFAULTS) for what it leaves out, softmax
    scores only, and `topk_method` as transformers' DeepseekV2 and the official V2 code compute it ("greedy" ignores
    n_group / topk_group)."""
    d = {**V2_DEFAULTS, **d}
    if d["scoring_func"] != "softmax":
        raise ValueError(
            f"{source}: scoring_func={d['scoring_func']!r} with model_type 'deepseek_v2' (DeepSeek-V2 models route "
            "with softmax scores, and transformers' DeepseekV2 computes softmax whatever the file says); a "
            "sigmoid-routed model is model_type 'deepseek_v3'"
        )
    method = d.get("topk_method") or "greedy"
    if method not in V2_TOPK_METHODS:
        raise ValueError(
            f"{source}: topk_method {method!r} is not a DeepSeek-V2 routing (one of {', '.join(V2_TOPK_METHODS)})"
        )
    if method == "greedy":
        d["n_group"] = d["topk_group"] = 1
    return d


def _check_hf_only(d: dict, source: str) -> None:
    """Fields we ignore but whose non-default values would change the model."""
    checks = {
        "hidden_act": "silu",
        "attention_bias": False,
        "moe_layer_freq": 1,
        "mlp_bias": False,
    }
    for key, want in checks.items():
        if key in d and d[key] != want:
            raise ValueError(f"{source}: {key}={d[key]!r} is not supported (only {want!r})")
    heads = d.get("num_key_value_heads")
    if heads is not None and "num_attention_heads" in d and heads != d["num_attention_heads"]:
        raise ValueError(
            f"{source}: num_key_value_heads ({heads}) must equal num_attention_heads ({d['num_attention_heads']})"
        )
    if d.get("model_type", "deepseek_v3") not in ("deepseek_v3", "deepseek_v2", "kimi_k2"):
        raise ValueError(f"{source}: model_type {d['model_type']!r} is not a DeepSeek-V2/V3 model")
