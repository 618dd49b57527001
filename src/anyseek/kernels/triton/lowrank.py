"""A weight with its low-rank update folded in, W + s B A, in one pass (LoRA's merged weight, `model.concat`); and
the adapters' gradients, s a^T b over many rows (`rows_product`).

PyTorch's `addmm(W, B, A)` first copies W into its output and then runs a rank-r matmul that reads that copy back
and writes it again: three passes over an [O, I] weight. Here each program loads its B rows and A columns (r wide),
forms their product with one tensor-core dot, adds the W tile it reads and writes the sum: one read of W and one
write. The product and the sum are fp32, rounded once to the output's dtype, as the twin's matmul does.

`rows_product`: dA = s (g B)^T x and dB = s g^T u reduce over all N rows (8k at 8k tokens) into an output with
one side r wide. cuBLAS runs each as a split-K GEMM plus a separate reduction kernel; here the routed experts'
weight-gradient kernel runs with one "expert" (`moe._wgrad`, DENSE): the rows in chunks over about two programs per
SM, each chunk's fp32 partial added up in chunk order by the tile's last program, the scale applied there.

Shape legend: O output rows, I input columns, r the rank (a power-of-two tile of at least 16, masked); N rows, P and
Q the two sides of a rows product.
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


def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 2  # the interpreter: a few programs, so that the tests see chunks
    return _SMS.setdefault(device.index, torch.cuda.get_device_properties(device).multi_processor_count)


_SMS: dict = {}
_ROWS_MIN_CHUNK = 256  # rows per program at least (the pipeline's fill is paid per chunk)
_ROWS_MAX_SPLIT = 32  # chunks per tile at most (the last program adds their partials up alone)


def rows_product(a: torch.Tensor, b: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    """As `kernels.reference.lowrank.rows_product` (the seam checked the shapes and dtypes)."""
    from anyseek.kernels.triton import moe

    N, P = a.shape
    Q = b.shape[1]
    if a.stride(1) != 1 or b.stride(1) != 1 or min(N, P, Q) == 0:
        from anyseek.kernels.reference.lowrank import rows_product as twin

        return twin(a, b, scale)
    interp = a.device.type != "cuda"
    narrow = 16 if interp else 128
    bm = max(16, triton.next_power_of_2(P)) if P < Q and P <= 64 else narrow
    bn = max(16, triton.next_power_of_2(Q)) if Q <= P and Q <= 64 else narrow
    cfg = {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": 16 if interp else 64, "GROUP_M": 8,
           "num_warps": 1 if interp else 4, "num_stages": 1 if interp else 4}  # fmt: skip
    tiles = triton.cdiv(P, bm) * triton.cdiv(Q, bn)
    min_chunk = 16 if interp else _ROWS_MIN_CHUNK
    split = max(1, min(triton.cdiv(2 * _sm_count(a.device), tiles), N // min_chunk, _ROWS_MAX_SPLIT))
    out = a.new_empty(1, P, Q)
    moe._wgrad(a, None, b, None, out, None, cfg, split, scale=scale, n_rows=N)
    return out[0]


def available(example: torch.Tensor) -> tuple[bool, str]:
    from anyseek.kernels.triton.check import available as triton_available

    return triton_available(example[..., :1])
