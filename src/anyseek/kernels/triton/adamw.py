"""AdamW over flat buffers in one Triton kernel, and the squared norm of a flat gradient.

`train.working_copy` keeps the trained weights in one flat fp32 buffer (the master weights), their bf16 working copy,
their gradients and both moments in flat buffers of their own (train/precision.py). torch's fused AdamW needs
gradients in the parameters' dtype and writes no working copy, so the step around it was: cast the bf16 gradients
to fp32, the multi-tensor AdamW kernel, cast the weights back to bf16 (40 bytes moved per weight, in ~2 x 150 casts
of which the dtype-converting ones run at half the bandwidth). Here one pass reads the gradient (2 bytes), weight
and moments (12) and writes them (12) and the working copy (2): 28 bytes per weight.

The maths is `kernels.reference.adamw`'s (torch.optim.AdamW's update). Offsets are int64 (flat buffers of large
models pass 2**31 elements).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

BLOCK = 2048  # elements per program: 8 per thread at 8 warps (16-byte fp32 loads), and few programs in flight


@triton.jit
def _adamw_kernel(P, G, M, V, LOW, SCALE, SKIP, n, lr, beta1, beta2, eps, decay, step_size, bc2_sqrt,
                  HAS_LOW: tl.constexpr, HAS_SKIP: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    if HAS_SKIP:  # a step skipped on the device: every load and store masked off (nothing read, nothing written)
        n = tl.where(tl.load(SKIP) == 0, n, 0)
    mask = offs < n
    g = tl.load(G + offs, mask=mask, other=0.0).to(tl.float32) / tl.load(SCALE)
    p = tl.load(P + offs, mask=mask, other=0.0)
    m = tl.load(M + offs, mask=mask, other=0.0)
    v = tl.load(V + offs, mask=mask, other=0.0)
    p = p * (1.0 - decay)
    m = m + (1.0 - beta1) * (g - m)  # lerp, as torch's
    v = beta2 * v + (1.0 - beta2) * g * g
    p = p - step_size * (m / (tl.sqrt(v) / bc2_sqrt + eps))
    tl.store(P + offs, p, mask=mask)
    tl.store(M + offs, m, mask=mask)
    tl.store(V + offs, v, mask=mask)
    if HAS_LOW:
        tl.store(LOW + offs, p.to(LOW.dtype.element_ty), mask=mask)


@triton.jit
def _sq_norm_kernel(X, OUT, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(X + offs, mask=offs < n, other=0.0).to(tl.float32)
    tl.store(OUT + tl.program_id(0), tl.sum(x * x, axis=0))


@torch.no_grad()
def adamw_flat(p, grad, m, v, low, scale, step, lr, beta1, beta2, eps, weight_decay, skip=None) -> None:
    """As `kernels.reference.adamw.adamw_flat`."""
    n = p.numel()
    if n == 0:
        return
    _adamw_kernel[(triton.cdiv(n, BLOCK),)](
        p, grad, m, v, low if low is not None else p, scale, skip if skip is not None else scale, n, lr, beta1,
        beta2, eps, lr * weight_decay, lr / (1.0 - beta1**step), math.sqrt(1.0 - beta2**step),
        HAS_LOW=low is not None, HAS_SKIP=skip is not None, BLOCK=BLOCK, num_warps=8,
    )  # fmt: skip


def sq_norm(x: torch.Tensor) -> torch.Tensor:
    """As `kernels.reference.adamw.sq_norm`: per-program partial sums in fp32, then one sum."""
    n = x.numel()
    partial = torch.empty(max(1, triton.cdiv(n, BLOCK)), dtype=torch.float32, device=x.device)
    if n == 0:
        return partial.zero_().sum()
    _sq_norm_kernel[(partial.numel(),)](x, partial, n, BLOCK=BLOCK, num_warps=8)
    return partial.sum()


def available(example: torch.Tensor) -> tuple[bool, str]:
    from anyseek.kernels.triton.check import available as triton_available

    return triton_available(example[..., :1])
