"""Run configuration: model, data and train sections, from a flavor name or a TOML/JSON file, plus dotted overrides.

    cfg = load_run_config("tiny", ["--train.max_steps=200", "--train.lr=3e-4"])

Every section is a dataclass; an unknown key or a value of the wrong type is a `ConfigError` that names the key and
lists the valid ones. The resolved config (`cfg.to_dict()`) is written beside every checkpoint.
"""

from __future__ import annotations

import dataclasses
import json
import math
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

try:
    import tomllib
except ImportError:  # Python 3.10
    import tomli as tomllib


class ConfigError(ValueError):
    """A bad configuration key or value; the message names it."""


# What train.lora_targets may name: attention projections, dense-layer MLPs, shared experts, routed experts.
LORA_TARGETS = ("attention", "dense_mlp", "shared_experts", "routed_experts")


@dataclass
class DataConfig:
    source: str = "wiki-sample"  # what `anyseek prepare --source` takes; prepared into the cache if `path` is unset
    path: str | None = None  # a folder written by `anyseek prepare` (overrides source)
    vocab_size: int = 4096  # BPE size when the source must be prepared here
    tokens_per_batch: int = 4096  # tokens in one micro-batch (whole documents packed, no padding)
    max_seqlen: int = 512  # longer documents are split into segments of at most this many tokens
    num_workers: int = 0  # reserved: the loader runs in the training process

    def __post_init__(self) -> None:
        _positive(self, "tokens_per_batch", "max_seqlen", "vocab_size")
        if self.max_seqlen > self.tokens_per_batch:
            raise ConfigError(
                f"data.max_seqlen ({self.max_seqlen}) must not exceed data.tokens_per_batch ({self.tokens_per_batch})"
            )


@dataclass
class TrainConfig:
    max_steps: int = 1000
    lr: float = 3e-3
    min_lr_ratio: float = 0.1  # final lr = lr * min_lr_ratio
    warmup_steps: int = 100
    schedule: str = "cosine"  # "cosine" or "wsd" (warmup-stable-decay)
    decay_fraction: float = 0.2  # wsd: the last fraction of steps decays linearly
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    grad_clip: float = 1.0  # 0 disables
    grad_accum: int = 1  # micro-batches per optimizer step
    seed: int = 0
    device: str = "auto"  # "auto", "cpu", "cuda", "cuda:1", ...
    dtype: str = "auto"  # autocast dtype: "auto" (bf16 on CUDA, none on CPU), "bf16", "fp32"
    threads: int = 0  # torch CPU threads; 0 = torch's default
    compile: bool = False
    # GPU: replay each micro-batch's forward and backward as a CUDA graph (train/graphs.py). "auto": on a CUDA device
    # in one process without train.compile; true: required (an error where it cannot be); false: never.
    cuda_graphs: bool | str = "auto"
    # Forward and backward on a bf16 copy of the fp32 master weights, cast once per optimizer step
    # (train/precision.py), instead of autocast casting each weight at each use. "auto": on a CUDA device in one
    # process when train.dtype computes in bf16; true: also on the CPU (train.dtype=bf16); false: autocast.
    working_copy: bool | str = "auto"
    # The host queues step N+1 before it reads step N's loss (a non-finite step is skipped on the device, and the
    # step queued after it run again); the steps applied are those of the one-at-a-time loop. It needs an optimizer
    # that skips on the device: the working copy's, or fused AdamW (CUDA). "auto": on with the working copy (one
    # process) and with fused AdamW under torchrun (FSDP2, one rank on an H200: 36.0 -> 31.6 ms a step); true: also
    # with fused AdamW in one process; false: never.
    overlap_steps: bool | str = "auto"
    # AdamW's two moments: "fp32", or "bf16" (DeepSeek-V3's low-precision optimizer states: stored in bf16 with
    # stochastic rounding, updated in fp32; 4 bytes per trained weight less and a faster optimizer step). bf16 needs
    # the working copy's optimizer (kernels.adamw_flat); the master weights stay fp32 either way.
    moments_dtype: str = "fp32"
    tune_allocator: bool = True  # CPU: glibc malloc keeps large blocks on its heap (anyseek.runtime)
    attention_backend: str = "auto"  # a kernel registry backend for attention: auto, triton, bmm, sdpa, reference, ...
    moe_backend: str = "auto"  # for the routed experts: auto, triton, grouped_mm, reference
    log_every: int = 10
    eval_every: int = 250
    eval_tokens: int = 65536  # validation tokens per evaluation
    save_every: int = 500
    keep_last: int = 3  # checkpoints kept in the output folder
    # Write checkpoints in the background (anyseek.checkpoint.background): the loop waits only while the state is
    # copied to (pinned) host memory, and a thread writes the same files while training goes on. "auto": on with a
    # CUDA device (16B on 4 GPUs writes ~186 GB a save); true: also on the CPU (one more copy of the model and
    # optimizer state in memory; the writer shares the cores with training); false: the loop waits for the files.
    async_save: bool | str = "auto"
    max_bad_steps: int = 5  # NaN/Inf losses in a row before the run stops
    sample_prompt: str = "The history of"
    sample_tokens: int = 40
    tensorboard: bool = True  # write event files when tensorboard is installed
    # "START:COUNT": a torch.profiler trace of COUNT steps from step START on, every rank its own, and a breakdown
    # of the step (compute, all-to-all, other communication, GPU idle, host syncs) in out_dir/profile/
    # (train/profile.py)
    profile: str = ""
    # Piecewise-constant schedules by tokens seen, [[from_tokens, value], ...] starting at 0; empty: the model
    # section's constant. The V3 report: MTP weight 0.3 for the first 10T tokens then 0.1
    # (mtp_loss_weight_schedule = [[0, 0.3], [10e12, 0.1]]); bias update speed 0.001 until 14.3T tokens, then 0.
    mtp_loss_weight_schedule: list = field(default_factory=list)
    bias_update_speed_schedule: list = field(default_factory=list)
    # Start from a pretrained model (`anyseek train --init PATH`; anyseek.train.init): a Hugging Face DeepSeek-V2/V3
    # folder or a step-N checkpoint. LoRA (anyseek.transforms.lora) when lora_rank > 0: the base frozen, adapters trained.
    init: str | None = None
    lora_rank: int = 0  # 0: full fine-tuning
    lora_alpha: float = 16.0  # adapter scale = lora_alpha / lora_rank
    lora_dropout: float = 0.0  # on the adapter input of the Linear layers the model calls (see lora.py)
    lora_targets: list = field(default_factory=lambda: list(LORA_TARGETS))
    # the frozen base: "auto" (bf16 when autocasting to bf16, else fp32), "bf16", "fp32" (with a GPU working copy,
    # which computes on bf16 copies, frozen tensors are held in bf16 whatever this says: train/precision.py)
    lora_base_dtype: str = "auto"
    # 16: the frozen base as lora_base_dtype says; 4: every weight LoRA targets (routed experts included) held in 4
    # bits, NF4 with per-64 bf16 scales (kernels/reference/quant4.py), the embedding and the output head in bf16
    base_bits: int = 16
    # "fp8": DeepSeek-V3's FP8 training recipe for the attention projections, dense MLPs, shared and routed experts
    # (anyseek.transforms.fp8; embedding, head, router, norms and attention stay in train.dtype); "bf16": none (every
    # matmul in train.dtype). fp8 needs a GPU of compute capability 8.9+ (or ANYSEEK_FP8=reference: the PyTorch
    # emulation, for tests)
    precision: str = "bf16"

    def __post_init__(self) -> None:
        _positive(self, "max_steps", "grad_accum", "log_every", "eval_every", "save_every", "keep_last",
                  "max_bad_steps")
        if self.schedule not in ("cosine", "wsd"):
            raise ConfigError(f"train.schedule must be 'cosine' or 'wsd', got {self.schedule!r}")
        if isinstance(self.cuda_graphs, bool):
            self.cuda_graphs = "true" if self.cuda_graphs else "false"
        if self.cuda_graphs not in ("auto", "true", "false"):
            raise ConfigError(f"train.cuda_graphs must be auto, true or false, got {self.cuda_graphs!r}")
        if isinstance(self.working_copy, bool):
            self.working_copy = "true" if self.working_copy else "false"
        if self.working_copy not in ("auto", "true", "false"):
            raise ConfigError(f"train.working_copy must be auto, true or false, got {self.working_copy!r}")
        if isinstance(self.overlap_steps, bool):
            self.overlap_steps = "true" if self.overlap_steps else "false"
        if self.overlap_steps not in ("auto", "true", "false"):
            raise ConfigError(f"train.overlap_steps must be auto, true or false, got {self.overlap_steps!r}")
        profile_window(self.profile)
        if isinstance(self.async_save, bool):
            self.async_save = "true" if self.async_save else "false"
        if self.async_save not in ("auto", "true", "false"):
            raise ConfigError(f"train.async_save must be auto, true or false, got {self.async_save!r}")
        if self.moments_dtype not in ("fp32", "bf16"):
            raise ConfigError(f"train.moments_dtype must be fp32 or bf16, got {self.moments_dtype!r}")
        if self.dtype not in ("auto", "bf16", "fp32"):
            raise ConfigError(f"train.dtype must be one of auto, bf16, fp32, got {self.dtype!r}")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ConfigError(f"train.min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")
        if not 0.0 < self.decay_fraction <= 1.0:
            raise ConfigError(f"train.decay_fraction must be in (0, 1], got {self.decay_fraction}")
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, float) and not math.isfinite(value):
                raise ConfigError(f"train.{f.name} must be a finite number, got {value}")
        if self.lr <= 0:
            raise ConfigError(f"train.lr must be positive, got {self.lr}")
        for name in ("mtp_loss_weight_schedule", "bias_update_speed_schedule"):
            _check_schedule(f"train.{name}", getattr(self, name))
        _check_lora(self)
        if self.precision not in ("bf16", "fp8"):
            raise ConfigError(f"train.precision must be bf16 or fp8, got {self.precision!r}")
        if self.precision == "fp8" and self.lora_rank:
            raise ConfigError("train.precision=fp8 trains full weights; with LoRA (train.lora_rank > 0) the base is "
                              "frozen: use train.precision=bf16")


@dataclass
class ParallelConfig:
    """[parallel]: used when the run is launched by torchrun (one process per device); see docs/distributed.md."""

    ep: int = 1  # expert parallelism: routed experts sharded over groups of this many ranks (divides world size)
    # how expert parallelism's rows travel in the training step: "fixed" (C rows per pair of ranks, no host sync, so
    # the step can replay as a CUDA graph; a step that needs more runs again on the exact path), "exact" (the split
    # sizes read on the host every MoE layer: eager only), "auto" (fixed on CUDA, exact on the CPU)
    ep_dispatch: str = "auto"
    # fixed: C = this many times a pair's fair share of rows (tokens * top_k / ep), at most the worst case
    # (tokens * min(top_k, experts per rank): never overflows); 0: the worst case
    ep_capacity_factor: float = 2.0
    # fixed: the shared experts compute while the dispatch's rows travel (forward), and their backward while the rows'
    # gradients travel back; false: each exchange waited for where it is issued (the same numbers either way)
    ep_overlap: bool = True
    # fixed: the exact dispatch (eager) until the routing has settled: this many steps in a row in which no pair of
    # ranks needed more than C / 1.25 rows; then the fixed shapes and CUDA graphs, and after an overflow the exact
    # dispatch again until it settles anew (early routing is far from balanced: on real text a 16B model's fullest
    # pair needed 3x its fair share at step 4, and graphs sized for that did not fit 4 H200s). 0: fixed from the first
    # step; an overflow only runs that step again (and C grows with ep_capacity_growth)
    ep_settle_steps: int = 10
    # fixed, ep_settle_steps=0: after an overflow C grows to 1.25x the rows the fullest pair needed (at most the worst
    # case), and the CUDA graphs are captured again; false: C stays, and every step that overflows runs again on the
    # exact dispatch
    ep_capacity_growth: bool = False
    backend: str = "auto"  # torch.distributed backend: auto (nccl on CUDA, gloo on CPU), nccl, gloo
    param_dtype: str = "auto"  # FSDP2 compute copy of the weights: auto (bf16 when autocast is bf16), bf16, fp32
    reduce_dtype: str = "fp32"  # gradient reduce-scatter dtype: fp32 or bf16
    # the dtype of FSDP2's shards: auto (bf16 where the run computes in bf16 with one micro-batch per step and no
    # expert parallelism, their fp32 master weights beside them; else fp32, the shards themselves the masters)
    shard_dtype: str = "auto"
    reshard_after_forward: bool = True  # ZeRO-3 (True) or keep gathered weights until backward (ZeRO-2-like)
    activation_checkpointing: str = "none"  # none, selective (every other decoder layer), full (every layer)
    timeout_s: int = 600  # a collective waiting longer than this (e.g. a rank died) fails with an error

    def __post_init__(self) -> None:
        if self.ep < 1:
            raise ConfigError(f"parallel.ep must be >= 1, got {self.ep}")
        if self.ep_capacity_factor < 0:
            raise ConfigError(f"parallel.ep_capacity_factor must be >= 0, got {self.ep_capacity_factor}")
        if self.ep_settle_steps < 0:
            raise ConfigError(f"parallel.ep_settle_steps must be >= 0, got {self.ep_settle_steps}")
        for name, allowed in (("backend", ("auto", "nccl", "gloo")), ("ep_dispatch", ("auto", "fixed", "exact")),
                              ("param_dtype", ("auto", "bf16", "fp32")),
                              ("reduce_dtype", ("bf16", "fp32")), ("shard_dtype", ("auto", "bf16", "fp32")),
                              ("activation_checkpointing", ("none", "selective", "full"))):
            if getattr(self, name) not in allowed:
                raise ConfigError(f"parallel.{name} must be one of {', '.join(allowed)}, got {getattr(self, name)!r}")
        if self.timeout_s <= 0:
            raise ConfigError(f"parallel.timeout_s must be positive, got {self.timeout_s}")


@dataclass
class ModelSection:
    """[model]: a flavor (tiny, small, 16B, 671B) plus overrides of ModelConfig fields, checked when the run config
    is loaded: an unknown key, a value of the wrong type or an invalid combination is a ConfigError naming it."""

    flavor: str = "tiny"
    overrides: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        from anyseek.model.config import ModelConfig
        from anyseek.model.flavors import FLAVORS

        if self.flavor not in FLAVORS:
            raise ConfigError(f"model.flavor {self.flavor!r} is unknown; known flavors: {', '.join(FLAVORS)}")
        hints = typing.get_type_hints(ModelConfig)
        valid = sorted(f.name for f in dataclasses.fields(ModelConfig) if f.name != "extra")
        for key, value in list(self.overrides.items()):
            if key not in valid:
                raise ConfigError(f"unknown key model.{key}; valid keys: flavor, {', '.join(valid)}")
            self.overrides[key] = _coerce(value, hints[key], f"model.{key}")
        self.resolve()  # up front: the combination must be a valid model

    def resolve(self, vocab_size: int | None = None):
        """The ModelConfig: the flavor, then the overrides; `vocab_size` (the tokenizer's) applies unless the
        section sets vocab_size itself."""
        from anyseek.model.config import ModelConfig

        overrides = dict(self.overrides)
        if vocab_size is not None and "vocab_size" not in overrides:
            overrides["vocab_size"] = vocab_size
        try:
            return ModelConfig.from_name(self.flavor, **overrides)
        except (TypeError, ValueError) as e:
            raise ConfigError(f"invalid [model] section: {e}") from e

    def to_dict(self) -> dict[str, Any]:
        return {"flavor": self.flavor, **self.overrides}


@dataclass
class RunConfig:
    """model (a flavor plus ModelConfig overrides, resolved by `model_config()`), data, train, parallel."""

    model: ModelSection = field(default_factory=ModelSection)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)

    def model_config(self, vocab_size: int | None = None):
        return self.model.resolve(vocab_size)

    def to_dict(self) -> dict[str, Any]:
        return {"model": self.model.to_dict(), "data": dataclasses.asdict(self.data),
                "train": dataclasses.asdict(self.train), "parallel": dataclasses.asdict(self.parallel)}


def named_configs() -> dict[str, Path]:
    """The run configs shipped with the package (`anyseek/configs/NAME.toml`), by name."""
    folder = Path(__file__).resolve().parent.parent / "configs"
    return {p.stem: p for p in sorted(folder.glob("*.toml"))}


def load_run_config(config: str | None = None, overrides: list[str] | None = None) -> RunConfig:
    """`config`: a shipped config's name (`named_configs()`: tiny, small), a model flavor (16B, 671B: that flavor with
    the default data and train sections), or a .toml/.json file; `overrides`: `--section.key=value`."""
    raw = _load_raw(config or "tiny")
    for item in overrides or []:
        section, key, value = _parse_override(item)
        raw.setdefault(section, {})[key] = value
    return from_dict(raw, origin=config or "tiny")


def from_dict(raw: dict[str, Any], origin: str = "<dict>") -> RunConfig:
    unknown = set(raw) - {"model", "data", "train", "parallel"}
    if unknown:
        raise ConfigError(f"{origin}: unknown section(s) {sorted(unknown)}; valid sections: model, data, train, "
                          "parallel")
    model = dict(raw.get("model") or {})
    flavor = model.pop("flavor", "tiny")
    if not isinstance(flavor, str):
        raise ConfigError(f"model.flavor must be str, got {flavor!r}")
    return RunConfig(
        model=ModelSection(flavor, model),
        data=_build(DataConfig, raw.get("data") or {}, "data"),
        train=_build(TrainConfig, raw.get("train") or {}, "train"),
        parallel=_build(ParallelConfig, raw.get("parallel") or {}, "parallel"),
    )


def _load_raw(config: str) -> dict[str, Any]:
    path = Path(config)
    if path.suffix in (".toml", ".json"):
        if not path.is_file():
            raise ConfigError(f"config file not found: {path}")
        try:
            text = path.read_text(encoding="utf-8")
            raw = tomllib.loads(text) if path.suffix == ".toml" else json.loads(text)
        except (tomllib.TOMLDecodeError, json.JSONDecodeError) as e:
            raise ConfigError(f"{path}: {e}") from e
        return raw
    named = named_configs()
    if config in named:
        return _load_raw(str(named[config]))
    from anyseek.model.flavors import FLAVORS

    if config not in FLAVORS:
        raise ConfigError(
            f"--config {config!r} is neither a .toml/.json file, a shipped config ({', '.join(named)}) nor a model "
            f"flavor ({', '.join(FLAVORS)})"
        )
    return {"model": {"flavor": config}}


def _parse_override(item: str) -> tuple[str, str, Any]:
    body = item.removeprefix("--")
    if "=" not in body or "." not in body.split("=", 1)[0]:
        raise ConfigError(f"override {item!r} must look like --section.key=value (e.g. --train.max_steps=200)")
    dotted, value = body.split("=", 1)
    section, key = dotted.split(".", 1)
    return section, key, _literal(value)


def _literal(text: str) -> Any:
    """Parse an override value as TOML would (numbers, booleans, quoted strings); anything else is a string."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def _build(cls: type, values: dict[str, Any], section: str):
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs = {}
    for key, value in values.items():
        if key not in hints:
            raise ConfigError(f"unknown key {section}.{key}; valid keys: {', '.join(names)}")
        kwargs[key] = _coerce(value, hints[key], f"{section}.{key}")
    return cls(**kwargs)


def _coerce(value: Any, hint: Any, name: str) -> Any:
    args = typing.get_args(hint)
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        for a in inner[:-1]:  # the first member the value is (bool | str: true/false, or a word)
            if a in (bool, int, float, str) and isinstance(value, a):
                return value
        return _coerce(value, inner[-1], name)
    if hint is bool:
        if isinstance(value, bool):
            return value
    elif hint is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
    elif hint is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    elif hint is str:
        if isinstance(value, str):
            return value
    else:
        return value
    raise ConfigError(f"{name} must be {hint.__name__}, got {value!r} ({type(value).__name__})")


def piecewise(schedule: list, tokens: int, default: float) -> float:
    """The value of a [[from_tokens, value], ...] schedule at `tokens` (the last step at or below it)."""
    value = default
    for start, v in schedule:
        if tokens >= start:
            value = float(v)
    return value


def _check_schedule(name: str, schedule: Any) -> None:
    ok = isinstance(schedule, list) and all(
        isinstance(p, (list, tuple)) and len(p) == 2 and all(isinstance(x, (int, float)) and not isinstance(x, bool)
                                                             for x in p) for p in schedule)
    if not ok:
        raise ConfigError(f"{name} must be a list of [from_tokens, value] pairs, got {schedule!r}")
    starts = [p[0] for p in schedule]
    if schedule and (starts[0] != 0 or starts != sorted(starts) or len(set(starts)) != len(starts)):
        raise ConfigError(f"{name} must start at 0 tokens and increase, got starts {starts}")
    if any(p[1] < 0 for p in schedule):
        raise ConfigError(f"{name} values must be >= 0, got {schedule!r}")


def _check_lora(t: TrainConfig) -> None:
    if t.lora_rank < 0:
        raise ConfigError(f"train.lora_rank must be >= 0 (0: full fine-tuning), got {t.lora_rank}")
    if t.lora_alpha <= 0:
        raise ConfigError(f"train.lora_alpha must be positive, got {t.lora_alpha}")
    if not 0.0 <= t.lora_dropout < 1.0:
        raise ConfigError(f"train.lora_dropout must be in [0, 1), got {t.lora_dropout}")
    if t.lora_base_dtype not in ("auto", "bf16", "fp32"):
        raise ConfigError(f"train.lora_base_dtype must be one of auto, bf16, fp32, got {t.lora_base_dtype!r}")
    bad = [x for x in t.lora_targets if x not in LORA_TARGETS] if isinstance(t.lora_targets, list) else [t.lora_targets]
    if bad or not t.lora_targets:
        raise ConfigError(f"train.lora_targets must be a non-empty list of {', '.join(LORA_TARGETS)}; "
                          f"got {t.lora_targets!r}")
    if t.lora_rank and not t.init:
        raise ConfigError("train.lora_rank needs a base model to adapt: pass --init PATH (or set train.init)")
    if t.base_bits not in (4, 16):
        raise ConfigError(f"train.base_bits must be 16 (the base as lora_base_dtype says) or 4 (NF4), got "
                          f"{t.base_bits!r}")
    if t.base_bits == 4 and not t.lora_rank:
        raise ConfigError("train.base_bits = 4 quantizes a frozen base: it needs LoRA (train.lora_rank > 0)")
    if t.lora_rank and t.bias_update_speed_schedule:
        raise ConfigError("train.bias_update_speed_schedule is not used with LoRA: the routing biases belong to the "
                          "frozen base")


def profile_window(spec: str) -> tuple[int, int] | None:
    """"START:COUNT" -> (START, COUNT); "" -> None. START is the first profiled step (1-based)."""
    if not spec:
        return None
    try:
        start, count = (int(x) for x in spec.split(":"))
    except ValueError:
        raise ConfigError(f"train.profile must look like START:COUNT (e.g. 20:3), got {spec!r}") from None
    if start < 1 or count < 1:
        raise ConfigError(f"train.profile {spec!r}: START and COUNT must be at least 1")
    return start, count


def _positive(obj: Any, *names: str) -> None:
    section = "data" if isinstance(obj, DataConfig) else "train"
    for n in names:
        if getattr(obj, n) <= 0:
            raise ConfigError(f"{section}.{n} must be positive, got {getattr(obj, n)}")
