"""The `torch` backend of `kernels.low_rank_linear`: a linear layer with a low-rank term beside its weight (LoRA),
x W^T + s (xd A^T) B^T, in PyTorch matmuls with a backward of its own (`_LowRankLinear`), which keeps neither
W + s B A nor a gradient of W's size.

Shape legend: N rows (all leading dims of x), in / out the layer's widths, r the rank (A's rows, all blocks').
"""

from __future__ import annotations

import torch

from anyseek import kernels


def _scaled_mm(a: torch.Tensor, b: torch.Tensor, scale: float) -> torch.Tensor:
    """scale * (a @ b) in one matmul (addmm's alpha; with beta 0 its input, a [1, 1] view of b that broadcasts, is
    not read: no tensor made for it)."""
    if scale == 1.0:
        return a @ b
    return torch.addmm(b[:1, :1], a, b, beta=0.0, alpha=scale)


def merge_wanted(rows: int, W: torch.Tensor, separate_input: bool) -> bool:
    """Whether `_LowRankLinear` applies the low-rank term through the merged weight W + s B A: when there are more
    rows than input features (a pass over the [rows, out] output costs more than forming the [out, in] weight; at
    8k tokens on `small` every adapted layer merges) and the term reads x itself (with dropout it reads xd)."""
    return not separate_input and rows > W.shape[1]


def _merged_weight(W: torch.Tensor, A: torch.Tensor, starts, Bs, scale: float, with_b: bool = False) -> torch.Tensor:
    """W + s B A in W's dtype, each block B_i added into its own rows (reading A's rows in order), fp32 sums.
    with_b: [W + s B A | B] -> [out, in + r], B block-diagonal in the last r columns (each block in its rows and its
    rank's columns, zeros elsewhere), so that one matmul gives both g (W + s B A) and g B."""
    O, I = W.shape
    R = A.shape[0] if with_b else 0
    if len(Bs) == 1 and starts[0] == 0 and Bs[0].shape[0] == O and not R:
        return kernels.low_rank_merge(W, Bs[0], A, scale)
    Wm = W.new_empty(O, I + R)
    r0, row = 0, 0
    for at, B in zip(starts, Bs):  # each block's rows written once by its merge; rows no block covers copied
        o, r = B.shape
        if at > row:
            Wm[row:at, :I].copy_(W[row:at])
            Wm[row:at, I:].zero_()
        kernels.low_rank_merge(W[at:at + o], B, A[r0:r0 + r], scale, out=Wm[at:at + o, :I],
                               b_out=Wm[at:at + o, I:] if R else None, b_at=r0)  # fmt: skip
        r0, row = r0 + r, at + o
    if row < O:
        Wm[row:, :I].copy_(W[row:])
        Wm[row:, I:].zero_()
    return Wm


class _LowRankLinear(torch.autograd.Function):
    """y = x W^T + s u B^T with u = xd A^T for 2-D x [N, in] (xd: the low-rank term's own input, e.g. x after
    dropout; x where None). B may come in blocks, each adding into its own output columns (layers joined by
    `fused_linear`: block i reads the i-th rows of A); the scale s is the matmuls' alpha. Two ways to add the term:

    - merged (`merge_wanted`: many rows, no dropout): y = x (W + s B A)^T, the merged weight formed for this matmul
      and again in backward (not kept: no weight-sized memory per layer), there with B beside it: [dx | g B] =
      g [W + s B A | B], one matmul (a narrow second one over g cost more than r more columns in the wide one:
      docs/benchmarks.md, stop 34). u = x A^T is still made in the forward, for B's gradient;
    - added: the term added into the base matmul's output (addmm: no [N, out] temporary) and likewise into dx =
      g W + s (g B) A: a pass over the output and one over dx, which cost more than the merge once N > in.

    Either way dA = s (g B)^T xd, dB = s g^T u, and W's gradient only where asked for. The merged weight is rounded
    to the compute dtype once (as a merged export is); the sums themselves are fp32 in both."""

    @staticmethod
    def forward(ctx, x, W, A, xd, scale, starts, *Bs):
        merged = merge_wanted(x.shape[0], W, xd is not None)
        # u: the term's input for the added way, and B's gradient either way (merged without one, e.g. evaluating:
        # not needed at all)
        u = (x if xd is None else xd) @ A.t() if not merged or any(ctx.needs_input_grad[6:]) else None
        if merged:
            y = x @ _merged_weight(W, A, starts, Bs, scale).t()
        else:
            y = x @ W.t()
            r0 = 0
            for at, B in zip(starts, Bs):  # (slices of y and u: views, written in place)
                o, r = B.shape
                y[:, at:at + o].addmm_(u[:, r0:r0 + r], B.t(), alpha=scale)
                r0 += r
        ctx.save_for_backward(x, W, A, u, xd, *Bs)
        ctx.scale, ctx.starts, ctx.merged = scale, starts, merged
        return y

    @staticmethod
    def backward(ctx, g):
        x, W, A, u, xd, *Bs = ctx.saved_tensors
        s, starts = ctx.scale, ctx.starts
        need = ctx.needs_input_grad
        gs = [g[:, at:at + B.shape[0]] for at, B in zip(starts, Bs)]  # each block's output columns (views)
        gB = dx = dW = dA = dxd = None
        if need[0] and ctx.merged:  # [dx | g B] in one matmul (g B only where the adapters train)
            with_b = need[2]
            d = g @ _merged_weight(W, A, starts, Bs, s, with_b=with_b)
            dx, gB = (d[:, :W.shape[1]], d[:, W.shape[1]:]) if with_b else (d, None)
        if gB is None and (need[2] or (xd is not None and need[3]) or (need[0] and xd is None and not ctx.merged)):
            gBs = [gi @ B for gi, B in zip(gs, Bs)]
            gB = torch.cat(gBs, dim=1) if len(gBs) > 1 else gBs[0]
        if need[0] and not ctx.merged:
            dx = g @ W
            if xd is None:
                dx.addmm_(gB, A, alpha=s)
        if xd is not None and need[3]:
            dxd = _scaled_mm(gB, A, s)
        if need[1]:
            dW = g.t() @ x
        if need[2]:
            dA = _scaled_mm(gB.t(), x if xd is None else xd, s)
        dBs, r0 = [], 0
        for gi, B, n in zip(gs, Bs, need[6:]):
            r = B.shape[1]
            dBs.append(_scaled_mm(gi.t(), u[:, r0:r0 + r], s) if n else None)
            r0 += r
        return dx, dW, dA, dxd, None, None, *dBs


def low_rank_linear(x: torch.Tensor, W: torch.Tensor, A: torch.Tensor, B, xd: torch.Tensor | None = None,
                    scale: float = 1.0) -> torch.Tensor:  # fmt: skip
    """The `torch` backend of `kernels.low_rank_linear` (shapes, blocks and dtypes there; the seam checked them):
    x W^T + scale (xd A^T) B^T through `_LowRankLinear`, the term added to the output or through a merged weight
    formed for each matmul."""
    return apply_flat(_LowRankLinear, x, lambda dt: W.to(dt), A, B, xd, scale)


def apply_flat(function, x: torch.Tensor, weight, A: torch.Tensor, B, xd: torch.Tensor | None, scale: float,
               extra: tuple = ()) -> torch.Tensor:  # fmt: skip
    """A low-rank linear Function applied as the backends share it: in autocast's dtype where it is on (else x's),
    x and xd flattened to 2-D, B's blocks as (start, B) pairs; function.apply(x, weight(dt), A, xd, scale, starts,
    *extra, *Bs) -> y, viewed back to x's leading dims."""
    kind = x.device.type
    dt = torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else x.dtype
    blocks = [(0, B)] if torch.is_tensor(B) else list(B)
    flat = [None if t is None else t.reshape(-1, t.shape[-1]).to(dt) for t in (x, xd)]
    with torch.autocast(kind, enabled=False):
        W = weight(dt)
        y = function.apply(flat[0], W, A.to(dt), flat[1], float(scale), tuple(at for at, _ in blocks), *extra,
                           *(b.to(dt) for _, b in blocks))  # fmt: skip
    # 2-D x: y itself, not a view of it. An in-place op on a view of a Function's output (rope_tail_ on q_b's output)
    # makes autograd copy the whole gradient back through CopySlices (~1.4 ms a step on `small` at 8k tokens)
    return y if x.dim() == 2 else y.view(*x.shape[:-1], W.shape[0])
