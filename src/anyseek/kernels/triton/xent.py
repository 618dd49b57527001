"""Fused cross-entropy rows in Triton: the loss and softmax - onehot of a chunk of logits in two reads and one write
of the chunk (the gradient written over the logits), instead of PyTorch's chain of fp32 passes (cast, max, gather,
softmax, max, scatter, cast back). The output head's matmuls stay with cuBLAS (`model/loss.py`); this is the part
between them, Liger's approach.

Maths as `kernels.reference.xent.cross_entropy_rows`: fp32 in registers whatever the logits' dtype. Pass 1 keeps
an online max and sum of exp over the row; lse = max + log(sum). Pass 2 writes exp(x - lse) - [col == label].
One program per row; BV columns per iteration.

Shape legend: C rows, V vocabulary, BV the column block.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _xent_rows_kernel(L, LABELS, NLL, stride_l, V, BV: tl.constexpr, WANT_GRAD: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    base = L + row * stride_l
    cols0 = tl.arange(0, BV)
    m = tl.full((), float("-inf"), tl.float32)
    s = tl.zeros((), tl.float32)
    for v0 in range(0, V, BV):
        cols = v0 + cols0
        x = tl.load(base + cols, mask=cols < V, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, tl.max(x, axis=0))
        s = s * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new), axis=0)
        m = m_new
    lse = m + tl.log(s)
    label = tl.load(LABELS + row).to(tl.int64)
    x_label = tl.load(base + label).to(tl.float32)
    tl.store(NLL + row, lse - x_label)
    if WANT_GRAD:  # written over the logits: each element is read before it is written, by this program alone
        for v0 in range(0, V, BV):
            cols = v0 + cols0
            mask = cols < V
            x = tl.load(base + cols, mask=mask, other=0.0).to(tl.float32)
            p = tl.exp(x - lse) - tl.where(cols == label, 1.0, 0.0)
            tl.store(base + cols, p.to(L.dtype.element_ty), mask=mask)


def cross_entropy_rows(logits_CV: torch.Tensor, labels_C: torch.Tensor, want_grad: bool
                       ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The Triton backend of `kernels.cross_entropy_rows`. With want_grad the gradient is written over `logits_CV`
    (over a contiguous copy if its last dim is strided) and returned; the caller must not need the logits afterwards.
    Under torch.compile the reference twin is traced instead (Inductor fuses that chain itself)."""
    if torch.compiler.is_compiling():
        from anyseek.kernels.reference.xent import cross_entropy_rows as reference

        return reference(logits_CV, labels_C, want_grad)
    C, V = logits_CV.shape
    nll = torch.empty(C, dtype=torch.float32, device=logits_CV.device)
    if logits_CV.stride(-1) != 1:
        logits_CV = logits_CV.contiguous()
    if C:
        bv = min(4096 if logits_CV.device.type == "cuda" else 256, triton.next_power_of_2(V))  # CPU: the interpreter
        _xent_rows_kernel[(C,)](logits_CV, labels_C.contiguous(), nll, logits_CV.stride(0), V, BV=bv,
                                WANT_GRAD=want_grad, num_warps=8 if bv >= 2048 else 4)
    return nll, (logits_CV if want_grad else None)


def available(example: torch.Tensor) -> tuple[bool, str]:
    """(ok, reason) for the fused cross-entropy rows on logits like `example` [C, V]."""
    from anyseek.kernels.triton.check import available as triton_available

    ok, reason = triton_available(example[..., :1])
    if not ok:
        return ok, reason
    return True, reason.replace("kernel", "fused cross-entropy")
