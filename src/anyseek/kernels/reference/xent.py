"""Pure-PyTorch twin of the fused cross-entropy kernel (`kernels.cross_entropy_rows`).

Shape legend: C rows (a chunk of tokens), V the vocabulary.
"""

from __future__ import annotations

import torch


def cross_entropy_rows(logits_CV: torch.Tensor, labels_C: torch.Tensor, want_grad: bool
                       ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per row: nll = logsumexp(logits) - logits[label] (fp32 [C]), and with want_grad, softmax(logits) - onehot(label)
    in logits' dtype ([C, V]; None without). Maths in fp32. The log-sum-exp is read off the softmax: its largest entry
    is exactly 1 / sum exp(x - max), so lse = max - log(max p), which never underflows."""
    x_CV = logits_CV.float()
    label_C1 = labels_C.long()[:, None]
    max_C = x_CV.amax(dim=-1)
    label_logit_C = x_CV.gather(1, label_C1)[:, 0]
    p_CV = torch.softmax(x_CV, dim=-1)
    nll_C = max_C - p_CV.amax(dim=-1).log() - label_logit_C
    if not want_grad:
        return nll_C, None
    g_CV = p_CV.scatter_add_(1, label_C1, torch.full_like(label_C1, -1, dtype=p_CV.dtype))
    return nll_C, g_CV.to(logits_CV.dtype)
