"""Weights used side by side without copying them together.

The model runs a few pairs of projections that read the same input as one matmul: MLA's q_a_proj | kv_a_proj_with_mqa
and an MLP's gate_proj | up_proj. Their weights are separate parameters (Hugging Face names), so joining them is a
`torch.cat` per forward. Where the pair already lies row after row in one buffer (the trainer's working copy lays
them out that way: `adjacent_weights` below, `train/precision.py`), `cat_rows` returns a view instead; the backward
hands each weight its rows of the joint gradient, as the concatenation's backward does.
"""

from __future__ import annotations

import torch
from torch import nn


class _CatRowsView(torch.autograd.Function):
    @staticmethod
    def forward(ctx, *ws):
        ctx.sizes = [w.shape[0] for w in ws]
        first = ws[0]
        return first.as_strided((sum(ctx.sizes), first.shape[1]), (first.shape[1], 1))

    @staticmethod
    def backward(ctx, grad):
        return grad.split(ctx.sizes, dim=0)


def rows_adjacent(ws: list[torch.Tensor]) -> bool:
    """Whether the 2-D tensors `ws` are consecutive row blocks of one contiguous buffer (same width and dtype)."""
    first = ws[0]
    if first.dim() != 2 or not first.is_contiguous():
        return False
    at = first.storage_offset()
    ptr = first.untyped_storage().data_ptr()
    for w in ws:
        if (w.dim() != 2 or w.shape[1] != first.shape[1] or not w.is_contiguous() or w.dtype != first.dtype
                or w.untyped_storage().data_ptr() != ptr or w.storage_offset() != at):
            return False
        at += w.numel()
    return True


def cat_rows(ws: list[torch.Tensor]) -> torch.Tensor:
    """torch.cat(ws) for 2-D weights [n_i, D]: a view when they are adjacent rows of one buffer, else a copy."""
    if not torch.compiler.is_compiling() and rows_adjacent(ws):  # (storage pointers do not trace)
        return _CatRowsView.apply(*ws)
    return torch.cat(ws)


def adjacent_weights(model: nn.Module) -> list[tuple[nn.Parameter, ...]]:
    """The parameter groups that `cat_rows` joins, in row order, for every module that declares them
    (`joined_weights()`); a buffer laid out with each group consecutive lets them be used without a copy."""
    groups = []
    for m in model.modules():
        fn = getattr(m, "joined_weights", None)
        if fn is not None:
            groups += [g for g in fn() if all(isinstance(w, nn.Parameter) for w in g)]
    return groups
