"""Joining and splitting tensors without copies, where the pieces already lie side by side in one buffer.

- `cat_rows`: the model runs a few pairs of projections that read the same input as one matmul: MLA's q_a_proj |
  kv_a_proj_with_mqa and an MLP's gate_proj | up_proj. Their weights are separate parameters (Hugging Face names), so
  joining them is a `torch.cat` per forward. Where the pair already lies row after row in one buffer (the trainer's
  working copy lays them out that way: `adjacent_weights` below, `train/precision.py`), it is a view instead; the
  backward hands each weight its rows of the joint gradient, as the concatenation's backward does.
  `fused_linear` is that matmul, for the layers themselves (a layer may add a low-rank term of its own: LoRA,
  through the seam `kernels.low_rank_linear`).
- `split_last`: MLA splits k_nope and v off one projection; when their gradients come back as adjacent slices of one
  buffer (the Triton attention writes them that way), the split's backward takes that buffer as it is.

Both rest on `joined_view`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from anyseek import kernels


def joined_view(parts, dim: int) -> torch.Tensor | None:
    """The tensor of which `parts` are consecutive slices along `dim` (one storage and dtype, equal strides and other
    dims, each starting where the one before ends, and the next index of the dim before `dim` where the joined slice
    ends), as a view; None when they are not."""
    first = parts[0]
    d = dim % first.dim()
    ptr = first.untyped_storage().data_ptr()
    at = first.storage_offset()
    for t in parts:
        if (t.dtype != first.dtype or t.stride() != first.stride() or t.untyped_storage().data_ptr() != ptr
                or t.shape[:d] + t.shape[d + 1:] != first.shape[:d] + first.shape[d + 1:] or t.storage_offset() != at):
            return None
        at += t.shape[d] * t.stride(d)
    shape = list(first.shape)
    shape[d] = sum(t.shape[d] for t in parts)
    if d and first.stride(d - 1) != shape[d] * first.stride(d):  # the joined rows must not overlap the next ones
        return None
    return first.as_strided(shape, first.stride())


class _CatRowsView(torch.autograd.Function):
    @staticmethod
    def forward(ctx, *ws):  # the caller checked that ws are adjacent rows (`rows_adjacent`)
        ctx.sizes = [w.shape[0] for w in ws]
        return ws[0].as_strided((sum(ctx.sizes), ws[0].shape[1]), ws[0].stride())

    @staticmethod
    def backward(ctx, grad):
        return grad.split(ctx.sizes, dim=0)


def rows_adjacent(ws: list[torch.Tensor]) -> bool:
    """Whether the 2-D tensors `ws` are consecutive row blocks of one buffer (same width and dtype)."""
    return all(w.dim() == 2 for w in ws) and joined_view(ws, 0) is not None


def cat_rows(ws: list[torch.Tensor]) -> torch.Tensor:
    """torch.cat(ws) for 2-D weights [n_i, D]: a view when they are adjacent rows of one buffer, else a copy."""
    if not torch.compiler.is_compiling() and rows_adjacent(ws):  # (storage pointers do not trace)
        return _CatRowsView.apply(*ws)
    return torch.cat(ws)


def fused_linear(x: torch.Tensor, layers: list[nn.Module]) -> torch.Tensor:
    """x @ [W_1; W_2; ...]^T for linear layers that read the same input: one matmul on their joined weights
    (`cat_rows`) -> [..., sum of their out_features], the layers' outputs side by side.

    A layer that carries a low-rank term outside its weight (LoRA, applied to a built model from outside) exposes
    `fused_weight` (the weight to join) and `fused_low_rank` (None, or (A [r, in], B [out, r], dropout or None,
    scale)); a plain nn.Linear has neither. The low-rank terms join too: A's stacked (one narrow matmul reads x),
    each B added into its layer's own output columns, in one `kernels.low_rank_linear` (the layers share one dropout
    mask on their common input). A layer may also bring the matmul itself, `fused_matmul(x, w)` (FP8 training's
    `kernels.fp8_linear`, applied from outside): the joined layers then must all bring the same one."""
    ws = [m.fused_weight if hasattr(m, "fused_weight") else m.weight for m in layers]  # (LoRA's .weight merges)
    lows = [getattr(m, "fused_low_rank", None) for m in layers]
    w = cat_rows(ws)
    if all(lo is None for lo in lows):
        matmul = getattr(layers[0], "fused_matmul", None)  # FP8 training's layers bring their own (transforms/fp8.py)
        if any(getattr(m, "fused_matmul", None) is not matmul for m in layers[1:]):
            raise ValueError(f"fused_linear: layers {[type(m).__name__ for m in layers]} multiply differently "
                             "(a transform must convert all the layers that the model joins, or none)")
        return F.linear(x, w) if matmul is None else matmul(x, w)
    starts = [0]
    for wi in ws[:-1]:
        starts.append(starts[-1] + wi.shape[0])
    terms = [(at, lo) for at, lo in zip(starts, lows) if lo]
    A = torch.cat([lo[0] for _, lo in terms]) if len(terms) > 1 else terms[0][1][0]
    scale = terms[0][1][3]
    if any(lo[3] != scale for _, lo in terms):  # (one alpha for all: else each B carries its own scale)
        blocks, scale = [(at, lo[1] * lo[3]) for at, lo in terms], 1.0
    else:
        blocks = [(at, lo[1]) for at, lo in terms]
    drop = next((lo[2] for _, lo in terms if lo[2] is not None), None)
    return kernels.low_rank_linear(x, w, A, blocks, None if drop is None else drop(x), scale)


class _SplitLast(torch.autograd.Function):
    """x.split(sizes, dim=-1) whose backward copies nothing when the gradients arrive as adjacent views of one
    buffer; otherwise it concatenates them as split's does."""

    @staticmethod
    def forward(ctx, x, sizes):
        ctx.sizes = sizes
        ctx.set_materialize_grads(False)
        return x.split(sizes, dim=-1)

    @staticmethod
    def backward(ctx, *grads):
        if all(g is not None for g in grads):
            joint = joined_view(grads, -1)
            if joint is not None:
                return joint, None
        ref = next(g for g in grads if g is not None)  # autograd calls no backward when every gradient is None
        parts = [g if g is not None else ref.new_zeros(*ref.shape[:-1], n) for g, n in zip(grads, ctx.sizes)]
        return torch.cat(parts, dim=-1), None


def split_last(x: torch.Tensor, sizes: list[int]) -> tuple[torch.Tensor, ...]:
    """x.split(sizes, dim=-1), with the copy-free backward of `_SplitLast`."""
    return _SplitLast.apply(x, sizes)


def join_rows(groups) -> None:
    """Lay out each group of 2-D parameters row after row in one new buffer (the parameters' data become its views),
    so that `cat_rows` reads them as a view instead of copying them at every forward; groups already laid out so, or
    of mixed dtypes, stay as they are. One group at a time (its size in extra memory while it is copied)."""
    for group in groups:
        parts = [p.data for p in group]
        if len({t.dtype for t in parts}) == 1 and joined_view(parts, 0) is None:
            joined = torch.cat(parts)
            for p, view in zip(group, joined.split([t.shape[0] for t in parts])):
                p.data = view


def adjacent_weights(model: nn.Module) -> list[tuple[nn.Parameter, ...]]:
    """The parameter groups that `cat_rows` joins, in row order, for every module that declares them
    (`joined_weights()`); a buffer laid out with each group consecutive lets them be used without a copy."""
    groups = []
    for m in model.modules():
        fn = getattr(m, "joined_weights", None)
        if fn is not None:
            groups += [g for g in fn() if all(isinstance(w, nn.Parameter) for w in g)]
    return groups
