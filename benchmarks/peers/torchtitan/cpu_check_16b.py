#!/usr/bin/env python3
"""Plumbing test of the 16B + EP harness on CPUs (gloo), no GPU: torchtitan's expert-parallel FSDP2 step with our
config module, at a tiny cut, for a few steps. Not a benchmark (torchtitan 0.3.0 is CUDA-only; this makes it see a
CPU "device" module), and it runs under this machine's torch, not the GPU machine's 2.11.

    TT_LAYERS=2 TT_VOCAB=512 TT_FLEX_AUTOTUNE=0 PYTHONPATH=<site with the wheels> \
    python -m torch.distributed.run --standalone --nproc_per_node=2 benchmarks/peers/torchtitan/cpu_check_16b.py \
        --module tt_dsv3_16b --config deepseek_v3_16b_ep --parallelism.expert_parallel_degree 2 \
        --training.local_batch_size 1 --training.seq_len 128 --training.steps 3 --training.mixed_precision_param float32

What it changes before torchtitan is imported: torch reports "cpu" as the accelerator, and the CPU module gets the
few CUDA-module calls torchtitan makes (device name and properties, memory statistics as empty, no-op cache
calls), each of which only feeds logging; FSDP2 reduces gradients with SUM and divides afterwards (gloo has no
PREMUL_SUM or AVG; the same arithmetic, as FSDP2 does on MTIA). FlexAttention has no backward on the CPU: its forward becomes causal
scaled_dot_product_attention, which is what its mask computes on the synthetic data (one document per sample).
The widths shrink (hidden 256, dense 512, expert 128, 4 heads of 32 + 16 rope, kv rank 64) so that a step takes
seconds on two CPU cores; the structure stays: 64 routed experts, 6 per token, 2 shared, the first layer dense.
TT_CPU_FULL_WIDTH=1 keeps the 16B widths (minutes per step).
"""

import os
import sys
import types

import torch
import torch._utils

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)


def pretend_cpu_is_the_device() -> None:
    torch._utils._get_available_device_type = lambda: "cpu"
    cpu = torch.cpu
    cpu.get_device_name = lambda device=None: "CPU (gloo plumbing test)"
    cpu.get_device_properties = lambda device=None: types.SimpleNamespace(
        name="CPU", total_memory=64 * 2**30, major=0, minor=0
    )
    cpu.memory_stats = lambda device=None: {}
    cpu.reset_peak_memory_stats = lambda device=None: None
    cpu.empty_cache = lambda: None
    cpu.current_device = lambda: 0


def sum_reductions_for_gloo() -> None:
    from torch.distributed.fsdp._fully_shard import _fsdp_collectives as collectives

    inner = collectives._get_gradient_divide_factors

    def factors(
        reduce_scatter_group,
        all_reduce_group,
        reduce_dtype,
        device_type="",
        factor=None,
        force_sum_reduction_for_comms=False,
    ):
        return inner(reduce_scatter_group, all_reduce_group, reduce_dtype, device_type, factor, True)

    collectives._get_gradient_divide_factors = factors


def causal_sdpa_for_flex() -> None:
    from torchtitan.models.common.attention import FlexAttention

    def forward(
        self,
        q_BLNH,
        k_BLNH,
        v_BLNH,
        *,
        attention_masks,
        score_mod=None,
        scale=None,
        enable_gqa=False,
        out_transform=None,
        **kwargs,
    ):
        if score_mod is not None or out_transform is not None:
            raise NotImplementedError("the CPU check replaces FlexAttention only without score_mod/out_transform")
        out_BNLH = torch.nn.functional.scaled_dot_product_attention(
            q_BLNH.transpose(1, 2),
            k_BLNH.transpose(1, 2),
            v_BLNH.transpose(1, 2),
            is_causal=True,
            scale=scale,
            enable_gqa=enable_gqa,
        )
        return out_BNLH.transpose(1, 2)

    FlexAttention.forward = forward


def main() -> None:
    pretend_cpu_is_the_device()
    sys.path.insert(0, launch_16b_peer())
    import launch

    launch.prepare()
    if os.environ.get("TT_CPU_FULL_WIDTH", "0") != "1":
        import tt_dsv3_16b

        tt_dsv3_16b.SHAPES.update(dim=256, dense_hidden_dim=512, moe_hidden_dim=128, n_heads=4, kv_lora_rank=64,
                                  qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32)  # fmt: skip
    sum_reductions_for_gloo()
    causal_sdpa_for_flex()
    from torchtitan.train import main as tt_main

    tt_main()


def launch_16b_peer() -> str:
    import launch_16b

    return launch_16b.peer_dir()


if __name__ == "__main__":
    main()
