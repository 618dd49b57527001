"""torchtitan 0.3.0 trainer config for anyseek's `16B` DeepSeek-V3 flavor with expert parallelism.

Used as ``--module tt_dsv3_16b --config deepseek_v3_16b_ep`` through launch_16b.py (torchtitan's ConfigManager
imports the module and calls the function). Importing it registers the flavor "anyseek16B" beside torchtitan's own
"16B" so ``model_registry("anyseek16B")`` works like a built-in one.

The shapes are anyseek's `16B` (src/anyseek/model/flavors.py, Moonlight-16B-A3B), not torchtitan's "16B"
(DeepSeek-V2-Lite / deepseek-moe-16b): the dense layer's intermediate size is 11264 (theirs 10944), routing is
sigmoid with normalized top-k weights scaled by 2.446 (theirs softmax, unscaled), rope theta 50000 without YaRN.

    HF field (anyseek 16B)          torchtitan
    vocab_size  (TT_VOCAB, 32000)   vocab_size: the data's BPE in `benchmarks/scale.py --data ...` runs, not 163840
    hidden_size 2048                dim
    num_hidden_layers (TT_LAYERS)   n_layers: 27 for the whole model; fewer layers cut it like
                                    --model.num_hidden_layers=L does in anyseek (layer 0 stays the dense one)
    first_k_dense_replace 1         n_dense_layers
    intermediate_size 11264         dense_hidden_dim
    num_attention_heads 16          n_heads
    q_lora_rank None                q_lora_rank 0 (one q projection, torchtitan's wq)
    kv_lora_rank 512, qk_nope 128, qk_rope 64, v_head 128
    n_routed_experts 64             num_experts
    moe_intermediate_size 1408      moe_hidden_dim
    num_experts_per_tok 6           router_top_k
    n_shared_experts 2              num_shared_experts (one shared FFN of 2 x 1408)
    scoring_func sigmoid, norm_topk_prob True, routed_scaling_factor 2.446
    n_group 1 / topk_group 1        router_num_expert_groups None (one group: the same routing)
    rope_theta 50000, no scaling    ComplexRoPE(theta=5e4, scaling="none")
    num_nextn_predict_layers 0      num_mtp_layers 0

Balancing: torchtitan's auxiliary-loss-free expert bias (load_balance_coeff 1e-3, updated before each optimizer
step); anyseek adds a sequence-wise balance loss of weight 1e-4 on top. Neither changes the step's FLOPs much.

Environment knobs (read when the config function runs, so every rank sees the same values):
    TT_LAYERS=27          decoder layers
    TT_VOCAB=32000        vocabulary size
    TT_AC=none            none | selective | full   activation checkpointing (torchtitan's SelectiveAC / FullAC)
    TT_LOSS=chunked       chunked (torchtitan's default ChunkedLossWrapper) | plain (one CE over all logits)
    TT_DUMP_FOLDER        torchtitan's output folder (default: a folder under the temporary directory)
The run's parallelism comes from the command line: ``--parallelism.expert_parallel_degree N`` (FSDP2 shards over
all ranks, data_parallel_shard_degree -1 = the world size; the routed experts' FSDP degree is world / EP).
"""

import os
import tempfile

import tt_dsv3_small  # the small harness's synthetic data loader and loss choice (from the copied peer folder)
from torchtitan.components.checkpoint import CheckpointManager
from torchtitan.components.metrics import MetricsProcessor
from torchtitan.components.optimizer import LRSchedulersContainer, default_adamw
from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
from torchtitan.distributed.activation_checkpoint import FullAC, SelectiveAC
from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm
from torchtitan.models.deepseek_v3 import (
    _EMBEDDING_INIT,
    _NORM_INIT,
    _build_dsv3_layers,
    _build_mtp_layers,
    _output_linear_init,
    deepseekv3_configs,
    model_registry,
)
from torchtitan.models.deepseek_v3.model import DeepSeekV3Model
from torchtitan.trainer import Trainer

FLAVOR = "anyseek16B"

# anyseek's 16B flavor (Moonlight-16B-A3B) in torchtitan's terms; vocab and depth come from the environment.
SHAPES = {
    "dim": 2048,
    "dense_hidden_dim": 11264,
    "moe_hidden_dim": 1408,
    "n_dense_layers": 1,
    "n_heads": 16,
    "q_lora_rank": 0,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "num_experts": 64,
    "router_top_k": 6,
    "num_shared_experts": 2,
    "router_route_scale": 2.446,
    "rope_theta": 50000.0,
    "max_seq_len": 8192,
}


def env_int(name: str, default: int) -> int:
    raw = os.environ.get(name, "")
    if not raw:
        return default
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not an integer") from None
    if value < 1:
        raise ValueError(f"{name}={value} must be at least 1")
    return value


def num_layers() -> int:
    return env_int("TT_LAYERS", 27)


def vocab_size() -> int:
    return env_int("TT_VOCAB", 32000)


def _anyseek16b(
    attn_backend: str,
    moe_comm_backend: str,
    non_blocking_capacity_factor: float | None = None,
    num_mtp_layers: int = 0,
) -> DeepSeekV3Model.Config:
    s = SHAPES
    n_layers, vocab, dim = num_layers(), vocab_size(), s["dim"]
    layers = _build_dsv3_layers(
        n_layers=n_layers,
        n_dense_layers=min(s["n_dense_layers"], n_layers),
        dim=dim,
        n_heads=s["n_heads"],
        q_lora_rank=s["q_lora_rank"],
        kv_lora_rank=s["kv_lora_rank"],
        qk_nope_head_dim=s["qk_nope_head_dim"],
        qk_rope_head_dim=s["qk_rope_head_dim"],
        v_head_dim=s["v_head_dim"],
        mscale=1.0,  # only read under YaRN scaling, which this flavor does not use
        dense_hidden_dim=s["dense_hidden_dim"],
        moe_hidden_dim=s["moe_hidden_dim"],
        num_experts=s["num_experts"],
        num_shared_experts=s["num_shared_experts"],
        router_top_k=s["router_top_k"],
        router_score_func="sigmoid",
        router_num_expert_groups=None,
        router_num_limited_groups=None,
        router_route_scale=s["router_route_scale"],
        router_route_norm=True,
        attn_backend=attn_backend,
        moe_comm_backend=moe_comm_backend,
        non_blocking_capacity_factor=non_blocking_capacity_factor,
        rope=ComplexRoPE.Config(
            dim=s["qk_rope_head_dim"],
            max_seq_len=s["max_seq_len"],  # the trainer resizes the cache to training.seq_len
            theta=s["rope_theta"],
            scaling="none",
        ),
    )
    return DeepSeekV3Model.Config(
        vocab_size=vocab,
        dim=dim,
        tok_embeddings=Embedding.Config(num_embeddings=vocab, embedding_dim=dim, param_init=_EMBEDDING_INIT),
        norm=RMSNorm.Config(normalized_shape=dim, param_init=_NORM_INIT),
        lm_head=Linear.Config(in_features=dim, out_features=vocab, param_init=_output_linear_init(dim)),
        layers=layers,
        mtp_layers=_build_mtp_layers(layers[-1], dim=dim, num_mtp_layers=num_mtp_layers),
    )


deepseekv3_configs[FLAVOR] = _anyseek16b


def activation_checkpoint():
    kind = os.environ.get("TT_AC", "none") or "none"
    if kind == "none":
        return None
    if kind == "selective":
        return SelectiveAC.Config()  # torchtitan's default for its 16B recipe
    if kind == "full":
        return FullAC.Config()
    raise ValueError(f"TT_AC must be none, selective or full, got {kind!r}")


def deepseek_v3_16b_ep() -> Trainer.Config:
    """anyseek's 16B on N GPUs: FSDP2 over every rank (bf16 params, fp32 master weights and reductions), routed
    experts split over expert_parallel_degree ranks through torchtitan's standard all-to-all token dispatcher
    (host-synced split sizes, so its CUDA-graphed step is off, as in torchtitan's own 16B recipe), fused AdamW,
    4 x 2048 random tokens per rank (8,192, as `benchmarks/scale.py` gives anyseek), no checkpoints."""
    model_spec = model_registry(FLAVOR, attn_backend="flex", moe_comm_backend="standard")
    return Trainer.Config(
        loss=tt_dsv3_small._loss_config(model_spec),
        hf_assets_path=os.path.join(os.path.dirname(os.path.abspath(tt_dsv3_small.__file__)), "tokenizer"),
        dump_folder=os.environ.get("TT_DUMP_FOLDER", os.path.join(tempfile.gettempdir(), "tt_outputs_16b")),
        metrics=MetricsProcessor.Config(log_freq=1),
        model_spec=model_spec,
        dataloader=tt_dsv3_small.SyntheticDataLoader.Config(vocab_size=vocab_size()),
        optimizer=default_adamw(lr=2.2e-4),  # betas (0.9, 0.95), eps 1e-8, wd 0.1, fused
        lr_scheduler=LRSchedulersContainer.Config(
            warmup_steps=2,
            decay_ratio=0.8,
            decay_type="linear",
            min_lr_factor=0.0,
        ),
        training=TrainingConfig(
            local_batch_size=4,
            seq_len=2048,
            steps=30,
            disable_cuda_graphs=True,
        ),
        parallelism=ParallelismConfig(
            data_parallel_shard_degree=-1,
            expert_parallel_degree=1,
            # DTensors on the expert axes only (FSDP2 as in torch 2.11): the default spmd_types path hands
            # fully_shard a dp_mesh_dims argument that torch before 2.12-ish does not take on multi-rank meshes
            spmd_backend="partial_dtensor",
        ),
        checkpoint=CheckpointManager.Config(enable=False),
        activation_checkpoint=activation_checkpoint(),
        compile=CompileConfig(enable=False, components=["model", "loss"]),
    )
