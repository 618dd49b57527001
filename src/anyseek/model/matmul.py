"""Matmuls whose result is wanted in fp32 from low-precision operands, on tensor cores.

A product of two bf16 (or fp16) numbers is exact in fp32, and cuBLAS sums them in fp32; so for bf16 operands
`mm(a, b, out_dtype=float32)` is what `a.float() @ b.float()` computes, up to the order of the sums, without the
fp32 copies of the operands and on tensor cores instead of fp32 SIMT. torch offers it on CUDA (probed once; elsewhere
the plain fp32 path runs).
"""

from __future__ import annotations

import functools

import torch


@functools.cache
def _out_dtype_ok(op: str) -> bool:
    """Whether torch's `mm` / `addmm` take out_dtype=float32 for bf16 operands on this CUDA build (probed once)."""
    a = torch.zeros(1, 1, dtype=torch.bfloat16, device="cuda")
    acc = torch.zeros(1, 1, device="cuda")
    try:
        if op == "mm":
            torch.mm(a, a, out_dtype=torch.float32)
        else:
            torch.addmm(acc, a, a, out_dtype=torch.float32, out=acc)
    except (RuntimeError, TypeError, NotImplementedError):
        return False
    return True


def add_mm_fp32(acc: torch.Tensor | None, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """acc (fp32, or None: start from zero) + a @ b, returned (acc updated in place when given). Low-precision a, b
    multiply on tensor cores and accumulate in fp32, written in fp32 where torch can (`mm` / `addmm` with
    out_dtype=float32, CUDA), else rounded to a's dtype first (as autocast's own gradients are)."""
    if a.dtype == torch.float32:
        return a @ b if acc is None else acc.addmm_(a, b)
    cuda = a.device.type == "cuda"
    if acc is not None and cuda and _out_dtype_ok("addmm"):  # the sum in the matmul's epilogue
        return torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)
    if cuda and _out_dtype_ok("mm"):
        prod = torch.mm(a, b, out_dtype=torch.float32)
    else:
        prod = a @ b
    return prod.float() if acc is None else acc.add_(prod)


class _LowFP32Linear(torch.autograd.Function):
    """x [N, K] @ w[M, K]^T -> fp32 [N, M] for x, w of one low-precision dtype (see `linear_fp32`)."""

    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return torch.mm(x, w.t(), out_dtype=torch.float32)

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        # the fp32 gradient as hi + lo in the operands' dtype (~16 significant bits for bf16), side by side along
        # the reduction: [hi | lo] @ [w; w] = hi w + lo w carries it at about fp32's accuracy in one tensor-core
        # product, summed in fp32 and rounded once to x's dtype. (Two products into an fp32 [N, K] result and a
        # cast moved ~0.6 GB per MoE layer at 32k tokens; this writes the bf16 dx alone.) The weight's gradient
        # reads x once: [hi | lo]^T x -> [2M, K] in fp32, whose halves add up.
        hi = g.to(x.dtype)
        hl = torch.cat([hi, (g - hi.float()).to(x.dtype)], dim=1)  # [N, 2M]
        dx = dw = None
        if ctx.needs_input_grad[0]:
            dx = torch.mm(hl, torch.cat([w, w]))
        if ctx.needs_input_grad[1]:
            M = w.shape[0]
            both = torch.mm(hl.t(), x, out_dtype=torch.float32)
            dw = (both[:M] + both[M:]).to(w.dtype)
        return dx, dw


def linear_fp32(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """F.linear(x.float(), w.float()) (no bias; x [..., K], w [M, K]) -> fp32 [..., M]. Where x and w share a
    low-precision dtype on CUDA the forward and both gradients run on tensor cores (see the module docstring and
    `_LowFP32Linear`); elsewhere the fp32 linear itself."""
    low = x.dtype in (torch.bfloat16, torch.float16) and w.dtype == x.dtype
    if low and x.device.type == "cuda" and not torch.compiler.is_compiling() and _out_dtype_ok("mm"):
        out = _LowFP32Linear.apply(x.reshape(-1, x.shape[-1]), w)
        return out if x.dim() == 2 else out.view(*x.shape[:-1], w.shape[0])
    return torch.nn.functional.linear(x.float(), w.float())
