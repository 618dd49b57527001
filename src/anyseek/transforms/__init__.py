"""Model transforms: a built DeepSeekV3 converted from outside for training, and back to a plain model for export.

    model = DeepSeekV3(cfg)                                  # or anyseek.load_pretrained(folder)
    for t in transforms.for_run(cfg.train, autocast_dtype):  # the run's transforms, in order
        model = t.apply(model)                              # in place: layers wrapped or converted
    ...train...
    model = t.revert(model)                                  # an ordinary DeepSeekV3 again (`anyseek export`)

A transform changes how layers hold and use their weights, never what the architecture computes: the model package
keeps DeepSeek-V3's maths and reaches a transformed layer's kernels through the seams (`kernels.low_rank_linear`,
`kernels.lora_routed_experts`), each with its reference twin. Transforms are applied after the model is built or
loaded and before it is parallelized (FSDP2, expert parallelism) and compiled; checkpoints keep what a transform
trains (LoRA: its adapters over the recorded base, `anyseek.checkpoint.adapters`).

    lora.py   LoRA: the base frozen (bf16 on a GPU, or its targets in 4 bits: `train.base_bits = 4`), low-rank
              adapters trained (`train.lora_*`)
    fp8.py    FP8 training, DeepSeek-V3's recipe, for the attention projections, dense MLPs, shared and routed
              experts (`train.precision = "fp8"`)
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import nn

from anyseek.transforms.fp8 import FP8
from anyseek.transforms.lora import LoRA, LoRASpec

__all__ = ["FP8", "LoRA", "LoRASpec", "Transform", "for_run"]


class Transform(Protocol):
    name: str

    def apply(self, model: nn.Module) -> nn.Module:
        """Convert `model` for training, in place; returns it."""

    def revert(self, model: nn.Module) -> nn.Module:
        """Undo `apply` (folding what was trained into plain layers), in place; returns a plain DeepSeekV3."""

    def describe(self, model: nn.Module) -> str:
        """One line for the training log: what was converted and what is trained."""


def for_run(train, autocast_dtype: torch.dtype | None) -> list[Transform]:
    """The transforms a run's `[train]` section asks for, in the order they apply (none for full training)."""
    out: list[Transform] = []
    if train.lora_rank:
        out.append(LoRA(LoRASpec.from_train(train), lora_base_dtype(train.lora_base_dtype, autocast_dtype)))
    if train.precision == "fp8":
        out.append(FP8())
    return out


def lora_base_dtype(name: str, autocast_dtype: torch.dtype | None) -> torch.dtype:
    """train.lora_base_dtype: auto = bf16 when the run autocasts to bf16 (its matmuls read bf16 anyway), else fp32."""
    if name == "auto":
        return torch.bfloat16 if autocast_dtype == torch.bfloat16 else torch.float32
    return {"bf16": torch.bfloat16, "fp32": torch.float32}[name]
