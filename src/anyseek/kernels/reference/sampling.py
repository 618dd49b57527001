"""Pure-PyTorch twin of the sampler's draw (`kernels.gumbel_argmax`): counter-based uniforms from each row's key,
Gumbel noise, the argmax. About fifteen elementwise passes over a [B, V] int64 tensor."""

from __future__ import annotations

import torch

GOLDEN, MIX1, MIX2 = 0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB  # splitmix64's constants


def _signed(c: int) -> int:
    return c - (1 << 64) if c >= 1 << 63 else c


def _srl(x: torch.Tensor, n: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's >> is arithmetic)."""
    return (x >> n) & ((1 << (64 - n)) - 1)


def uniform(keys_B: torch.Tensor, V: int) -> torch.Tensor:
    """Counter-based uniforms in (0, 1), fp32 [B, V]: splitmix64 of key_b + (v + 1) * golden, on the device."""
    x = keys_B[:, None] + torch.arange(1, V + 1, device=keys_B.device, dtype=torch.int64) * _signed(GOLDEN)
    x = (x ^ _srl(x, 30)) * _signed(MIX1)
    x = (x ^ _srl(x, 27)) * _signed(MIX2)
    x = x ^ _srl(x, 31)
    return (_srl(x, 40).float() + 0.5) * (1.0 / (1 << 24))  # 24 random bits, never 0 or 1


def gumbel_argmax(logits_BV: torch.Tensor, keys_B: torch.Tensor) -> torch.Tensor:
    """As `anyseek.kernels.gumbel_argmax`."""
    return (logits_BV - torch.log(-torch.log(uniform(keys_B, logits_BV.shape[-1])))).argmax(dim=-1)
