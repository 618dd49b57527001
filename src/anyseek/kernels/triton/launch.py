"""Launching a Triton kernel with settings tuned on H100/H200 on any GPU: the one home of the shared-memory fallback
that the attention, MoE and decode kernels use."""

from __future__ import annotations

import torch

# Pipelining depth that fits in shared memory, per (kernel, device, launch settings, constexprs): the settings
# come from H100/H200 (228 KB per SM); GPUs with less (A100 164 KB, consumer cards ~100 KB) get fewer stages.
_STAGES: dict[tuple, int] = {}


def launch(kernel, grid, cfg: dict):
    """kernel[grid] with cfg's launch settings, lowering num_stages while the GPU lacks shared memory for them."""

    def run(*args, **meta):
        from triton.runtime.errors import OutOfResources

        key = (kernel.fn.__name__, torch.cuda.current_device() if torch.cuda.is_available() else -1,
               tuple(cfg.items()), tuple(sorted(meta.items())))  # fmt: skip
        stages = _STAGES.get(key, cfg["num_stages"])
        while True:
            try:
                kernel[grid](*args, **meta, **{**cfg, "num_stages": stages})
                _STAGES[key] = stages
                return
            except OutOfResources:
                if stages <= 1:
                    raise
                stages -= 1

    return run
