"""The triton backend of `kernels.lora_routed_experts` for 4-bit frozen stacks: LoRA's routed experts
(`ops/moe.py: _LoRARoutedExperts`, `moe_lora.py`) unchanged, their grouped GEMMs reading the packed stacks
(gate_up [E, F, 17D/32], down [E, D, 17I/32] uint8: `reference/quant4.py`) and dequantizing tile by tile in the
loop over K (`moe_gemm.py`'s QUANT: `moe.py`'s `_gemm` sees a uint8 stack). The same fused gather, SwiGLU, scatter
and combine, the same adapters inside the GEMMs; nothing [E, F, D]-sized is formed, in bf16 or otherwise.

Shape legend: T tokens, E experts, D hidden, I expert width, F = 2I, r the adapters' rank.
"""

from __future__ import annotations

import torch

from anyseek.kernels.ops.moe import _lora_apply


def lora_routed_experts(x_TD, topk_ids_TK, topk_weights_TK, gate_up_EFP, down_EDP, A_gu, B_gu, A_dn, B_dn,
                        scale: float, add_TD: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
    """As `kernels.lora_routed_experts` with packed stacks; -> [T, D] in x's dtype. Under torch.compile: the
    reference (the stacks dequantized, then the effective weights: the LoRA Function launches its kernels itself)."""
    if torch.compiler.is_compiling():
        from anyseek.kernels.reference.quant4 import lora_routed_experts as reference

        return reference(x_TD, topk_ids_TK, topk_weights_TK, gate_up_EFP, down_EDP, A_gu, B_gu, A_dn, B_dn, scale,
                         add_TD)  # fmt: skip
    return _lora_apply(x_TD, topk_ids_TK, topk_weights_TK, gate_up_EFP.detach().contiguous(),
                       down_EDP.detach().contiguous(), A_gu, B_gu, A_dn, B_dn, scale, add_TD, x_TD.dtype)  # fmt: skip


__all__ = ["lora_routed_experts"]
