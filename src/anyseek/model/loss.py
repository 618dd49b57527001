"""Cross-entropy over the vocabulary, mean over non-ignored labels, computed in fp32.

A small autograd Function instead of F.cross_entropy: the forward keeps the fp32 log-softmax, and the backward
writes exp(logp) - onehot directly (no zero-filled [T, V] gradient, no scatter into it, no log-softmax backward).
Measured on one CPU core for [4096, 4096]: 75 ms forward + backward against 97 ms for F.cross_entropy.

Shape legend: T tokens, V vocab.
"""

from __future__ import annotations

import torch

IGNORE_INDEX = -100


class _CrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits_TV: torch.Tensor, labels_T: torch.Tensor) -> torch.Tensor:
        valid_T = labels_T != IGNORE_INDEX
        count = valid_T.sum().clamp(min=1)
        safe_T = labels_T.clamp(min=0)  # ignored rows read class 0; their loss and gradient are masked out
        logp_TV = torch.log_softmax(logits_TV.float(), dim=-1)
        ctx.save_for_backward(logp_TV, safe_T, valid_T, count)
        ctx.logits_dtype = logits_TV.dtype
        return -(logp_TV.gather(1, safe_T[:, None])[:, 0] * valid_T).sum() / count

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        logp_TV, safe_T, valid_T, count = ctx.saved_tensors
        grad_TV = logp_TV.exp()  # softmax
        grad_TV.scatter_add_(1, safe_T[:, None], torch.full_like(safe_T[:, None], -1, dtype=grad_TV.dtype))
        grad_TV.mul_((grad_out / count * valid_T)[:, None])
        return grad_TV.to(ctx.logits_dtype), None


def cross_entropy(logits_TV: torch.Tensor, labels_T: torch.Tensor) -> torch.Tensor:
    """logits [T, V] (any float dtype), labels int [T] (IGNORE_INDEX = skip) -> fp32 scalar: the mean loss over
    non-ignored labels, 0 when all are ignored. No host sync."""
    if labels_T.shape != logits_TV.shape[:1]:
        raise ValueError(f"labels shape {tuple(labels_T.shape)} must be [T] for logits {tuple(logits_TV.shape)}")
    return _CrossEntropy.apply(logits_TV, labels_T)
