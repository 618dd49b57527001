"""A weight with its low-rank update folded in, W + s B A, in one pass (LoRA's merged weight, `model.concat`).

PyTorch's `addmm(W, B, A)` first copies W into its output and then runs a rank-r matmul that reads that copy back
and writes it again: three passes over an [O, I] weight. Here each program loads its B rows and A columns (r wide),
forms their product with one tensor-core dot, adds the W tile it reads and writes the sum: one read of W and one
write. The product and the sum are fp32, rounded once to the output's dtype, as the twin's matmul does.

With `b_out` the same launch also writes B into a strip beside the merged rows (one more column of programs): LoRA's
backward multiplies its output gradient by [W + s B A | B] once, for dx and g B together (`model.concat`).

Shape legend: O output rows, I input columns, r the rank (a power-of-two tile of at least 16, masked).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Small tiles and 2 warps: these weights are small (a step of `small` merges 0.3-8M-element weights 126 times), so
# more programs hide more latency. H200, one step's merges as launched: 383 us at 64 x 128 with 4 warps, 355 here.
BLOCK_O, BLOCK_I, WARPS = 32, 64, 2


@triton.jit
def _merge_kernel(W, B, A, OUT, BOUT, O, I, r, b_at, RT, stride_w, stride_b, stride_a, stride_out, stride_bout, scale,
                  RANK: tl.constexpr, BLOCK_O: tl.constexpr, BLOCK_I: tl.constexpr, IEEE: tl.constexpr,
                  B_COLS: tl.constexpr, RT_BLOCK: tl.constexpr):  # fmt: skip
    rows = tl.program_id(0) * BLOCK_O + tl.arange(0, BLOCK_O)
    rmask = rows < O
    rows64 = rows.to(tl.int64)
    if B_COLS and tl.program_id(1) == tl.num_programs(1) - 1:  # the strip: BOUT[:, b_at + k] = B[:, k], zeros around
        c = tl.arange(0, RT_BLOCK)
        k = c - b_at
        bs = tl.load(B + rows64[:, None] * stride_b + k[None, :], mask=rmask[:, None] & ((k >= 0) & (k < r))[None, :],
                    other=0.0)  # fmt: skip
        tl.store(BOUT + rows64[:, None] * stride_bout + c[None, :], bs.to(BOUT.dtype.element_ty),
                 mask=rmask[:, None] & (c < RT)[None, :])  # fmt: skip
    else:
        cols = tl.program_id(1) * BLOCK_I + tl.arange(0, BLOCK_I)
        ks = tl.arange(0, RANK)
        cmask, kmask = cols < I, ks < r
        b = tl.load(B + rows64[:, None] * stride_b + ks[None, :], mask=rmask[:, None] & kmask[None, :], other=0.0)
        a = tl.load(A + ks[:, None] * stride_a + cols[None, :], mask=kmask[:, None] & cmask[None, :], other=0.0)
        if IEEE:
            d = tl.dot(b, a, input_precision="ieee")
        else:
            d = tl.dot(b, a)
        mask = rmask[:, None] & cmask[None, :]
        w = tl.load(W + rows64[:, None] * stride_w + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        tl.store(OUT + rows64[:, None] * stride_out + cols[None, :], (w + scale * d).to(OUT.dtype.element_ty),
                 mask=mask)  # fmt: skip


def low_rank_merge(W: torch.Tensor, B: torch.Tensor, A: torch.Tensor, scale: float, out: torch.Tensor | None = None,
                   b_out: torch.Tensor | None = None, b_at: int = 0) -> torch.Tensor:  # fmt: skip
    """As `kernels.reference.lowrank.low_rank_merge` (the seam checked the shapes and dtypes)."""
    O, I = W.shape
    r = A.shape[0]
    if out is None:
        out = torch.empty_like(W, memory_format=torch.contiguous_format)
    if any(t.stride(-1) != 1 for t in (W, B, A, out) + ((b_out,) if b_out is not None else ())):
        from anyseek.kernels.reference.lowrank import low_rank_merge as twin

        return twin(W, B, A, scale, out, b_out, b_at)
    if O == 0 or (I == 0 and b_out is None):
        return out
    RT = b_out.shape[1] if b_out is not None else 0
    grid = (triton.cdiv(O, BLOCK_O), triton.cdiv(I, BLOCK_I) + (b_out is not None))
    _merge_kernel[grid](W, B, A, out, out if b_out is None else b_out, O, I, r, b_at, RT, W.stride(0), B.stride(0),
                        A.stride(0), out.stride(0), 0 if b_out is None else b_out.stride(0), float(scale),
                        RANK=max(16, triton.next_power_of_2(r)), BLOCK_O=BLOCK_O, BLOCK_I=BLOCK_I,
                        IEEE=W.dtype == torch.float32, B_COLS=b_out is not None,
                        RT_BLOCK=max(16, triton.next_power_of_2(RT)), num_warps=WARPS)  # fmt: skip
    return out


def available(example: torch.Tensor) -> tuple[bool, str]:
    from anyseek.kernels.triton.check import available as triton_available

    return triton_available(example[..., :1])
