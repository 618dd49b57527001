"""Pure-PyTorch twins of the fused AdamW kernels (`kernels.adamw_flat`, `kernels.adamw_tensors`) and of the squared
gradient norm.

The update is torch.optim.AdamW's (decoupled weight decay, bias-corrected moments), on flat buffers:
    g = grad / scale;  p *= 1 - lr * wd;  m = b1 m + (1 - b1) g;  v = b2 v + (1 - b2) g^2;
    p -= lr / (1 - b1^t) * m / (sqrt(v) / sqrt(1 - b2^t) + eps);  low = p rounded to low's dtype.
bf16 moments are read as fp32, updated, and stored with stochastic rounding driven by a hash of (seed, element
index): the kernel's hash, so both round alike wherever their fp32 results agree.
"""

from __future__ import annotations

import math

import torch

_MASK32 = 0xFFFFFFFF


def _hash32(x: torch.Tensor) -> torch.Tensor:
    """The kernel's 32-bit hash on int64 tensors holding uint32 values (products wrap; the low 32 bits are kept)."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _MASK32
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & _MASK32
    return x ^ (x >> 16)


def random16(n: int, seed: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """The two uniform 16-bit numbers per element (for m and for v) that rounding uses at `seed`."""
    s = _hash32(torch.tensor(seed & 0x7FFFFFFF, dtype=torch.int64))
    r = _hash32(torch.arange(n, dtype=torch.int64, device=device) & _MASK32 ^ s.to(device))
    return r & 0xFFFF, r >> 16


def round_bf16_stochastic(x: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
    """fp32 x -> bf16: x's bits plus r (uniform in [0, 2^16)) with the low half dropped, i.e. rounded up with
    probability equal to the dropped fraction (unbiased); NaN stays NaN."""
    bits = x.contiguous().view(torch.int32).to(torch.int64) & _MASK32
    hi = ((bits + r) >> 16) & 0xFFFF
    hi = torch.where(torch.isnan(x), 0x7FC0, hi)
    return (hi - ((hi >> 15) << 16)).to(torch.int16).view(torch.bfloat16)


@torch.no_grad()
def adamw_flat(p: torch.Tensor, grad: torch.Tensor, m: torch.Tensor, v: torch.Tensor, low: torch.Tensor | None,
               scale: torch.Tensor, step: int, lr: float, beta1: float, beta2: float, eps: float, weight_decay: float,
               skip: torch.Tensor | None = None, seed: int = 0) -> None:
    """One AdamW step in place over 1-D fp32 p, moments m, v (fp32, or bf16: stochastic rounding at `seed`), the
    gradient (any float dtype) divided by the device scalar `scale`, and the working copy `low` (or None) written
    from the new p. skip: a device scalar; nonzero leaves every buffer as it is (decided on the device, without a
    host sync)."""
    if skip is not None and not skip.is_cuda:  # read here at no cost (no device to wait for)
        if skip.item():
            return
        skip = None
    if skip is not None:  # on a GPU, decided there: the old values kept aside and chosen back where skipped
        keep = skip != 0
        olds = [t.clone() for t in (p, m, v)] + ([] if low is None else [low.clone()])
        adamw_flat(p, grad, m, v, low, scale, step, lr, beta1, beta2, eps, weight_decay, seed=seed)
        for t, old in zip((p, m, v) + (() if low is None else (low,)), olds):
            t.copy_(torch.where(keep, old, t))
        return
    g = grad.float() / scale
    p.mul_(1.0 - lr * weight_decay)
    m32, v32 = m.float(), v.float()  # fp32 moments: these are m and v themselves, updated in place
    m32.lerp_(g, 1.0 - beta1)
    v32.mul_(beta2).addcmul_(g, g, value=1.0 - beta2)
    denom = (v32.sqrt() / math.sqrt(1.0 - beta2**step)).add_(eps)
    p.addcdiv_(m32, denom, value=-lr / (1.0 - beta1**step))
    if m.dtype == torch.bfloat16:
        r_m, r_v = random16(p.numel(), seed, p.device)
        m.copy_(round_bf16_stochastic(m32, r_m))
        v.copy_(round_bf16_stochastic(v32, r_v))
    if low is not None:
        low.copy_(p)


@torch.no_grad()
def adamw_tensors(params, grads, exp_avgs, exp_avg_sqs, steps, scale, lr, beta1, beta2, eps, weight_decay,
                  skip=None, lows=None) -> None:
    """`adamw_flat` (fp32 moments) on each tensor of the lists in turn: contiguous fp32 weights and moments,
    gradients of one float dtype, each tensor's step number in its own 0-dim fp32 tensor (the caller counts it
    before the update, as torch's AdamW), and (lows, or None) each weight's low-precision copy, written from the new
    weights."""
    lows = [None] * len(params) if lows is None else lows
    for p, g, m, v, step, low in zip(params, grads, exp_avgs, exp_avg_sqs, steps, lows, strict=True):
        adamw_flat(p.view(-1), g.reshape(-1), m.view(-1), v.view(-1), None if low is None else low.view(-1), scale,
                   int(step.item()), lr, beta1, beta2, eps, weight_decay, skip=skip)


def sq_norm(x: torch.Tensor) -> torch.Tensor:
    """sum(x^2) in fp32 (a 0-dim tensor) of a 1-D tensor of any float dtype."""
    return x.float().square().sum()
