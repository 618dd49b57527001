"""ModelConfig: the model's shape and training-loss knobs, with Hugging Face DeepseekV3Config field names.

All validation lives in `ModelConfig.validate` (called from `__post_init__`); every error names the field.
RoPE scaling is stored as `rope_theta` + `rope_scaling` (both spellings of the type key accepted).
Reading and writing config.json is `anyseek.hf.config`'s job: this file knows nothing of Hugging Face.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field

ROPE_KEYS = frozenset(
    {"rope_type", "type", "factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "mscale",
     "mscale_all_dim", "rope_theta", "attention_factor", "truncate"}
)  # fmt: skip


# The fields of ModelConfig that are training knobs, not the model's shape: Hugging Face folders keep them under
# their own key (`anyseek.hf.config`), and a run started from a folder (`--init`) may set them (`train/init.py`).
TRAINING_KNOBS = ("aux_loss_alpha", "bias_update_speed", "mtp_loss_weight", "init_std")


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
        for name in TRAINING_KNOBS:
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
