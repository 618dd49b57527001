"""Pure-PyTorch twins of every kernel: the fallback on any device and the oracle in tests.

attention.py: varlen_attention, mla_attention. moe.py: routed_experts and its bookkeeping (permute/unpermute),
lora_routed_experts. decode.py, norm.py, swiglu.py, rope.py, xent.py, router.py, adamw.py, lowrank.py: the others'
(`kernels/registry.py` names each op's twin).
"""

from anyseek.kernels.reference.attention import mla_attention, varlen_attention
from anyseek.kernels.reference.moe import routed_experts

__all__ = ["mla_attention", "routed_experts", "varlen_attention"]
