"""A weight with its low-rank update folded in, W + s B A, in one pass (LoRA's merged weight, `model.concat`).

PyTorch's `addmm(W, B, A)` first copies W into its output and then runs a rank-r matmul that reads that copy back
and writes it again: three passes over an [O, I] weight. Here each program loads its B rows and A columns (r wide),
forms their product with one tensor-core dot, adds the W tile it reads and writes the sum: one read of W and one
write. The product and the sum are fp32, rounded once to the output's dtype, as the twin's matmul does.

Shape legend: O output rows, I input columns, r the rank (a power-of-two tile of at least 16, masked).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_O, BLOCK_I = 64, 128


@triton.jit
def _merge_kernel(W, B, A, OUT, O, I, r, stride_w, stride_b, stride_a, stride_out, scale,
                  RANK: tl.constexpr, BLOCK_O: tl.constexpr, BLOCK_I: tl.constexpr, IEEE: tl.constexpr):  # fmt: skip
    rows = tl.program_id(0) * BLOCK_O + tl.arange(0, BLOCK_O)
    cols = tl.program_id(1) * BLOCK_I + tl.arange(0, BLOCK_I)
    ks = tl.arange(0, RANK)
    rmask, cmask, kmask = rows < O, cols < I, ks < r
    rows64 = rows.to(tl.int64)
    b = tl.load(B + rows64[:, None] * stride_b + ks[None, :], mask=rmask[:, None] & kmask[None, :], other=0.0)
    a = tl.load(A + ks[:, None] * stride_a + cols[None, :], mask=kmask[:, None] & cmask[None, :], other=0.0)
    if IEEE:
        d = tl.dot(b, a, input_precision="ieee")
    else:
        d = tl.dot(b, a)
    mask = rmask[:, None] & cmask[None, :]
    w = tl.load(W + rows64[:, None] * stride_w + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    tl.store(OUT + rows64[:, None] * stride_out + cols[None, :], (w + scale * d).to(OUT.dtype.element_ty), mask=mask)


def low_rank_merge(W: torch.Tensor, B: torch.Tensor, A: torch.Tensor, scale: float,
                   out: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
    """As `kernels.reference.lowrank.low_rank_merge` (the seam checked the shapes and dtypes)."""
    O, I = W.shape
    r = A.shape[0]
    if out is None:
        out = torch.empty_like(W, memory_format=torch.contiguous_format)
    if any(t.stride(-1) != 1 for t in (W, B, A, out)):
        from anyseek.kernels.reference.lowrank import low_rank_merge as twin

        return twin(W, B, A, scale, out)
    if O == 0 or I == 0:
        return out
    grid = (triton.cdiv(O, BLOCK_O), triton.cdiv(I, BLOCK_I))
    _merge_kernel[grid](W, B, A, out, O, I, r, W.stride(0), B.stride(0), A.stride(0), out.stride(0), float(scale),
                        RANK=max(16, triton.next_power_of_2(r)), BLOCK_O=BLOCK_O, BLOCK_I=BLOCK_I,
                        IEEE=W.dtype == torch.float32, num_warps=4)  # fmt: skip
    return out


def available(example: torch.Tensor) -> tuple[bool, str]:
    from anyseek.kernels.triton.check import available as triton_available

    return triton_available(example[..., :1])
