"""ModelConfig: the model's shape and training-loss knobs, with Hugging Face DeepseekV3Config field names.

A config.json round-trips through `from_hf_dict` / `to_hf_dict`. All validation lives in `ModelConfig.validate`
(called from `__post_init__`); every error names the field. RoPE scaling is accepted in both spellings
(`rope_scaling` + `rope_theta`, and the newer `rope_parameters`) and stored as `rope_theta` + `rope_scaling`.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math
from dataclasses import dataclass, field
from pathlib import Path

# Keys a Hugging Face / official config.json may carry that do not change the model we build.
# (Some are checked for values we cannot honour, see _check_hf_only.)
IGNORED_HF_KEYS = frozenset(
    {
        "_name_or_path",
        "architectures",
        "auto_map",
        "model_type",
        "torch_dtype",
        "dtype",
        "transformers_version",
        "bos_token_id",
        "eos_token_id",
        "pad_token_id",
        "attention_bias",
        "attention_dropout",
        "hidden_act",
        "initializer_range",
        "use_cache",
        "ep_size",
        "moe_layer_freq",
        "topk_method",
        "quantization_config",
        "pretraining_tp",
        "head_dim",
        "qk_head_dim",
        "num_key_value_heads",
        "seq_aux",
        "output_router_logits",
        "router_aux_loss_coef",
        "return_dict",
        "output_hidden_states",
        "output_attentions",
        "torchscript",
        "chunk_size_feed_forward",
        "is_encoder_decoder",
        "id2label",
        "label2id",
        "problem_type",
        "num_mtp_layers",
        "tokenizer_class",
        "use_return_dict",
        "tie_encoder_decoder",
        "is_decoder",
        "add_cross_attention",
        "cross_attention_hidden_size",
        "prefix",
        "sep_token_id",
        "decoder_start_token_id",
        "task_specific_params",
        "finetuning_task",
        "tf_legacy_loss",
        "use_bfloat16",
        "max_length",
        "generation_config",
    }
)
ROPE_KEYS = frozenset(
    {"rope_type", "type", "factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "mscale",
     "mscale_all_dim", "rope_theta", "attention_factor", "truncate"}
)  # fmt: skip


@dataclass
class ModelConfig:
    """DeepSeek-V3 architecture. Defaults are DeepSeek-V3's (as in transformers' DeepseekV3Config)."""

    vocab_size: int = 129280
    hidden_size: int = 7168
    intermediate_size: int = 18432
    moe_intermediate_size: int = 2048
    num_hidden_layers: int = 61
    num_attention_heads: int = 128
    q_lora_rank: int | None = 1536  # None: plain q_proj
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    n_routed_experts: int = 256
    n_shared_experts: int = 1
    num_experts_per_tok: int = 8
    n_group: int = 8
    topk_group: int = 4
    routed_scaling_factor: float = 2.5
    norm_topk_prob: bool = True
    scoring_func: str = "sigmoid"  # "sigmoid" (V3) or "softmax" (V2)
    first_k_dense_replace: int = 3
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None  # None or {"type": "yarn", "factor", "original_max_position_embeddings", ...}
    rope_interleave: bool = True
    max_position_embeddings: int = 4096
    num_nextn_predict_layers: int = 1
    tie_word_embeddings: bool = False
    # anyseek training knobs (not architecture)
    aux_loss_alpha: float = 1e-4  # sequence-wise balance loss weight
    bias_update_speed: float = 1e-3  # gamma of auxiliary-loss-free balancing
    mtp_loss_weight: float = 0.3  # lambda
    init_std: float = 0.006
    extra: dict = field(default_factory=dict, repr=False, compare=False)  # token ids kept for config.json round trips

    def __post_init__(self) -> None:
        if self.q_lora_rank == 0:  # the official configs spell "no q LoRA" as 0
            self.q_lora_rank = None
        if self.rope_scaling is not None:
            self.rope_scaling = _normalize_rope(dict(self.rope_scaling))
        self.validate()

    # ---- derived sizes -------------------------------------------------------------------------------------
    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def n_moe_layers(self) -> int:
        """MoE layers, MTP modules' included: the rows of ModelOutput.expert_load."""
        if not self.n_routed_experts:
            return 0
        return self.num_hidden_layers - self.first_k_dense_replace + self.num_nextn_predict_layers

    def is_moe_layer(self, layer_idx: int) -> bool:
        """MTP modules use layer_idx >= num_hidden_layers and are MoE like the last layers."""
        return self.n_routed_experts > 0 and layer_idx >= self.first_k_dense_replace

    # ---- validation ----------------------------------------------------------------------------------------
    def validate(self) -> None:
        positive = [
            "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
            "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "max_position_embeddings",
        ]  # fmt: skip
        for name in positive:
            _check(isinstance(getattr(self, name), int) and getattr(self, name) > 0, name, "a positive integer")
        non_negative = ["n_routed_experts", "n_shared_experts", "first_k_dense_replace", "num_nextn_predict_layers"]
        for name in non_negative:
            _check(isinstance(getattr(self, name), int) and getattr(self, name) >= 0, name, "an integer >= 0")
        _check(self.q_lora_rank is None or (isinstance(self.q_lora_rank, int) and self.q_lora_rank > 0),
               "q_lora_rank", "None or a positive integer")  # fmt: skip
        _check(self.qk_rope_head_dim % 2 == 0, "qk_rope_head_dim", "even (RoPE rotates pairs)")
        _check(self.rms_norm_eps > 0, "rms_norm_eps", "> 0")
        _check(self.rope_theta > 0, "rope_theta", "> 0")
        _check(self.scoring_func in ("sigmoid", "softmax"), "scoring_func", "'sigmoid' or 'softmax'")
        if self.first_k_dense_replace > self.num_hidden_layers:
            raise ValueError(
                f"first_k_dense_replace ({self.first_k_dense_replace}) must be <= num_hidden_layers "
                f"({self.num_hidden_layers})"
            )
        if self.n_routed_experts:
            self._validate_moe()
        for name in ("aux_loss_alpha", "bias_update_speed", "mtp_loss_weight", "init_std"):
            _check(getattr(self, name) >= 0, name, ">= 0")

    def _validate_moe(self) -> None:
        E, K = self.n_routed_experts, self.num_experts_per_tok
        _check(isinstance(self.moe_intermediate_size, int) and self.moe_intermediate_size > 0,
               "moe_intermediate_size", "a positive integer")  # fmt: skip
        _check(isinstance(self.n_group, int) and self.n_group > 0, "n_group", "a positive integer")
        if E % self.n_group:
            raise ValueError(f"n_routed_experts ({E}) must be divisible by n_group ({self.n_group})")
        if not 1 <= self.topk_group <= self.n_group:
            raise ValueError(f"topk_group ({self.topk_group}) must be between 1 and n_group ({self.n_group})")
        if not 1 <= K <= self.topk_group * (E // self.n_group):
            raise ValueError(
                f"num_experts_per_tok ({K}) must be between 1 and topk_group * experts per group "
                f"({self.topk_group} * {E // self.n_group})"
            )
        if self.n_group > 1 and self.scoring_func == "sigmoid" and E // self.n_group < 2:
            raise ValueError(
                f"n_group ({self.n_group}) leaves fewer than 2 experts per group; sigmoid group scores sum the top 2"
            )
        _check(self.routed_scaling_factor > 0, "routed_scaling_factor", "> 0")

    # ---- construction --------------------------------------------------------------------------------------
    @classmethod
    def from_name(cls, name: str, **overrides) -> ModelConfig:
        """A named flavor (tiny, small, 16B, 671B), optionally with fields overridden."""
        from anyseek.model.flavors import FLAVORS

        if name not in FLAVORS:
            raise ValueError(f"unknown model flavor {name!r}; known: {', '.join(FLAVORS)}")
        return cls(**{**copy.deepcopy(FLAVORS[name]), **overrides})

    @classmethod
    def from_hf_dict(cls, d: dict, source: str = "config") -> ModelConfig:
        """From a Hugging Face / official config.json dict. Unknown keys are an error naming the key."""
        d = dict(d)
        _check_hf_only(d, source)
        own = {f.name for f in dataclasses.fields(cls)} - {"extra"}
        kwargs = {k: v for k, v in d.items() if k in own}
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
        kwargs["extra"] = {k: d[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if k in d}
        try:
            return cls(**kwargs)
        except ValueError as e:
            raise ValueError(f"{source}: {e}") from None

    @classmethod
    def from_json_file(cls, path: str | Path) -> ModelConfig:
        """A config.json (Hugging Face format); errors name the file."""
        path = Path(path)
        try:
            d = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: not valid JSON (line {e.lineno}: {e.msg})") from None
        if not isinstance(d, dict):
            raise ValueError(f"{path}: expected a JSON object at the top level")  # noqa: TRY004
        return cls.from_hf_dict(d, source=str(path))

    def to_hf_dict(self) -> dict:
        """A config.json dict that transformers' DeepseekV3Config (and ours) reads back."""
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "extra"}
        d = copy.deepcopy(d)
        rope = {"rope_type": "default", "rope_theta": self.rope_theta}
        if self.rope_scaling is not None:
            rope = {**self.rope_scaling, "rope_theta": self.rope_theta}
        d["rope_parameters"] = rope  # transformers >= 5; rope_theta / rope_scaling stay for 4.x and the official code
        d.update(
            model_type="deepseek_v3",
            architectures=["DeepseekV3ForCausalLM"],
            num_key_value_heads=self.num_attention_heads,
            hidden_act="silu",
            attention_bias=False,
            topk_method="noaux_tc" if self.scoring_func == "sigmoid" else "greedy",
        )
        d.update(copy.deepcopy(self.extra))
        return d

    def to_json_file(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_hf_dict(), indent=2, sort_keys=True) + "\n")

    # ---- RoPE helpers ---------------------------------------------------------------------------------------
    def yarn_mscale(self) -> float:
        """Softmax-scale correction of YaRN: (0.1 * mscale_all_dim * ln(factor) + 1)^2, 1 without YaRN."""
        rs = self.rope_scaling
        if rs is None or not rs.get("mscale_all_dim"):
            return 1.0
        return yarn_get_mscale(rs["factor"], rs["mscale_all_dim"]) ** 2

    @property
    def softmax_scale(self) -> float:
        return self.qk_head_dim**-0.5 * self.yarn_mscale()


def yarn_get_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _check(ok: bool, name: str, what: str) -> None:
    if not ok:
        raise ValueError(f"config field {name} must be {what}")


def _normalize_rope(rs: dict) -> dict | None:
    unknown = set(rs) - ROPE_KEYS
    if unknown:
        raise ValueError(f"unknown key(s) in rope_scaling: {', '.join(sorted(unknown))}")
    kind = rs.pop("rope_type", None) or rs.pop("type", None) or "default"
    rs.pop("type", None)
    rs.pop("rope_theta", None)
    if kind == "default":
        return None
    if kind != "yarn":
        raise ValueError(f"rope_scaling type {kind!r} is not supported (only 'default' and 'yarn')")
    for key in ("factor", "original_max_position_embeddings"):
        if key not in rs:
            raise ValueError(f"rope_scaling (yarn) needs {key}")
    if not rs["factor"] >= 1:
        raise ValueError(f"rope_scaling factor must be >= 1, got {rs['factor']}")
    if rs.get("truncate", True) is not True:
        raise ValueError("rope_scaling truncate=False is not supported")
    rs.pop("truncate", None)
    return {"type": "yarn", **rs}


def _check_hf_only(d: dict, source: str) -> None:
    """Fields we ignore but whose non-default values would change the model."""
    checks = {
        "hidden_act": "silu",
        "attention_bias": False,
        "moe_layer_freq": 1,
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
