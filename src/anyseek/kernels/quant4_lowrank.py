"""`kernels.low_rank_linear` over a 4-bit frozen weight (`reference/quant4.py`'s packed rows): x dq(W)^T + s (xd
A^T) B^T with a backward of its own, which keeps W packed (no dequantized copy saved) and computes no gradient for
it (the base is frozen). The two products with the base weight come from the backend: fused dequant-GEMM kernels
(`triton/quant4_linear.py`) or PyTorch's dequantize-then-matmul (`reference/quant4.py`).

Shape legend: N rows (all leading dims of x), in / out the layer's widths, r the rank (A's rows, all blocks').
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from anyseek.kernels.torch_lowrank import apply_flat

MM = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


class Quant4LowRank(torch.autograd.Function):
    """y = x dq(W)^T + s u B^T, u = xd A^T (xd: x where None); B in blocks [(first column, B_i)] over A's rows in
    order. Backward: dx = g dq(W) + s (g B) A (without dropout; with it the term's part goes to xd), dA = s (g B)^T
    xd, dB_i = s g_i^T u_i. mm_wt(x, W) = x dq(W)^T and mm_w(g, W) = g dq(W) are the backend's products."""

    @staticmethod
    def forward(ctx, x, W, A, xd, scale, starts, mm_wt, mm_w, *Bs):
        u = (x if xd is None else xd) @ A.t()
        y = mm_wt(x, W)
        r0 = 0
        for at, B in zip(starts, Bs):
            o, r = B.shape
            y[:, at:at + o].addmm_(u[:, r0:r0 + r], B.t(), alpha=scale)
            r0 += r
        ctx.save_for_backward(x, W, A, u, xd, *Bs)
        ctx.scale, ctx.starts, ctx.mm_w = scale, starts, mm_w
        return y

    @staticmethod
    def backward(ctx, g):
        x, W, A, u, xd, *Bs = ctx.saved_tensors
        s, need = ctx.scale, ctx.needs_input_grad
        gs = [g[:, at:at + B.shape[0]] for at, B in zip(ctx.starts, Bs)]
        gBs = [gi @ B for gi, B in zip(gs, Bs)]
        gB = torch.cat(gBs, dim=1) if len(gBs) > 1 else gBs[0]
        dx = dxd = dA = None
        if need[0]:
            dx = ctx.mm_w(g, W)
            if xd is None:
                dx.addmm_(gB, A, alpha=s)
        if xd is not None and need[3]:
            dxd = s * (gB @ A)
        if need[2]:
            dA = s * (gB.t() @ (x if xd is None else xd))
        dBs, r0 = [], 0
        for gi, B, n in zip(gs, Bs, need[8:]):
            r = B.shape[1]
            dBs.append(s * (gi.t() @ u[:, r0:r0 + r]) if n else None)
            r0 += r
        return dx, None, dA, dxd, None, None, None, None, *dBs


def quant4_low_rank_linear(x: torch.Tensor, W: torch.Tensor, A: torch.Tensor, B, xd: torch.Tensor | None,
                           scale: float, mm_wt: MM, mm_w: MM) -> torch.Tensor:  # fmt: skip
    """x [..., in] -> [..., out] through `Quant4LowRank` in autocast's dtype where it is on, else x's; W packed
    [out, 17 in / 32] (the seam checked the shapes)."""
    return apply_flat(Quant4LowRank, x, lambda dt: W.detach(), A, B, xd, scale, (mm_wt, mm_w))


__all__ = ["Quant4LowRank", "quant4_low_rank_linear"]
