"""Pure-PyTorch twin of the fused AdamW kernel (`kernels.adamw_flat`) and of the squared gradient norm.

The update is torch.optim.AdamW's (decoupled weight decay, bias-corrected moments), on flat buffers:
    g = grad / scale;  p *= 1 - lr * wd;  m = b1 m + (1 - b1) g;  v = b2 v + (1 - b2) g^2;
    p -= lr / (1 - b1^t) * m / (sqrt(v) / sqrt(1 - b2^t) + eps);  low = p rounded to low's dtype.
"""

from __future__ import annotations

import math

import torch


@torch.no_grad()
def adamw_flat(p: torch.Tensor, grad: torch.Tensor, m: torch.Tensor, v: torch.Tensor, low: torch.Tensor | None,
               scale: torch.Tensor, step: int, lr: float, beta1: float, beta2: float, eps: float, weight_decay: float,
               skip: torch.Tensor | None = None) -> None:
    """One AdamW step in place over 1-D fp32 p, m, v, the gradient (any float dtype) divided by the device scalar
    `scale`, and the working copy `low` (or None) written from the new p. skip: a device scalar; nonzero leaves
    every buffer as it is (decided on the device, without a host sync)."""
    if skip is not None and not skip.is_cuda:  # read here at no cost (no device to wait for)
        if skip.item():
            return
        skip = None
    if skip is not None:  # on a GPU, decided there: the old values kept aside and chosen back where skipped
        keep = skip != 0
        olds = [t.clone() for t in (p, m, v)] + ([] if low is None else [low.clone()])
        adamw_flat(p, grad, m, v, low, scale, step, lr, beta1, beta2, eps, weight_decay)
        for t, old in zip((p, m, v) + (() if low is None else (low,)), olds):
            t.copy_(torch.where(keep, old, t))
        return
    g = grad.float() / scale
    p.mul_(1.0 - lr * weight_decay)
    m.lerp_(g, 1.0 - beta1)
    v.mul_(beta2).addcmul_(g, g, value=1.0 - beta2)
    denom = (v.sqrt() / math.sqrt(1.0 - beta2**step)).add_(eps)
    p.addcdiv_(m, denom, value=-lr / (1.0 - beta1**step))
    if low is not None:
        low.copy_(p)


def sq_norm(x: torch.Tensor) -> torch.Tensor:
    """sum(x^2) in fp32 (a 0-dim tensor) of a 1-D tensor of any float dtype."""
    return x.float().square().sum()
