"""Pure-PyTorch twins of every kernel: the fallback on any device and the oracle in tests.

attention.py: varlen_attention, mla_attention. moe.py: routed_experts and its bookkeeping (permute/unpermute).
"""

from anyseek.kernels.reference.attention import mla_attention, varlen_attention

try:  # moe.py is added by the model work; keep attention importable meanwhile
    from anyseek.kernels.reference.moe import routed_experts
except ImportError:  # pragma: no cover
    pass

__all__ = ["mla_attention", "routed_experts", "varlen_attention"]
