"""SwiGLU of the dense MLP and the shared experts in one Triton kernel each way.

The gate and up projections run as one matmul whose output holds [gate | up] side by side. PyTorch's path from there
is chunk, silu, mul forward (three kernels, and silu's output kept for the backward) and silu_backward, two muls and
the chunk's backward (a concatenation of the two gradients) back. Here the forward reads [gate | up] once and writes
silu(gate) * up; the backward reads [gate | up] and the output's gradient once and writes d[gate | up] as one buffer,
which is the matmul's output gradient as it is (no concatenation). The maths is `kernels.reference.swiglu`'s,
computed in fp32 and rounded once:
    s = sigmoid(g);  out = g s u;  du = dout g s;  dg = dout u s (1 + g (1 - s)).

Shape legend: N rows (all leading dims), I the output width (the input is [N, 2I]), BR x BC a program's tile.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BR, BC = 8, 512  # 4096 elements per program at 4 warps: 32 per thread, 16-byte loads along the rows


@triton.jit
def _tile(GU, N, I, stride_gu, BR: tl.constexpr, BC: tl.constexpr):
    """This program's rows and columns, their mask, and the gate and up values there (fp32)."""
    rows = tl.program_id(0).to(tl.int64) * BR + tl.arange(0, BR)
    cols = tl.program_id(1) * BC + tl.arange(0, BC)
    mask = (rows < N)[:, None] & (cols < I)[None, :]
    at = rows[:, None] * stride_gu + cols[None, :]
    g = tl.load(GU + at, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(GU + at + I, mask=mask, other=0.0).to(tl.float32)
    return rows, cols, mask, g, u


@triton.jit
def _swiglu_fwd_kernel(GU, OUT, N, I, stride_gu, stride_out, BR: tl.constexpr, BC: tl.constexpr):
    rows, cols, mask, g, u = _tile(GU, N, I, stride_gu, BR, BC)
    out = g * tl.sigmoid(g) * u
    tl.store(OUT + rows[:, None] * stride_out + cols[None, :], out.to(OUT.dtype.element_ty), mask=mask)


@triton.jit
def _swiglu_bwd_kernel(GU, DOUT, DGU, N, I, stride_gu, stride_do, stride_dgu, BR: tl.constexpr, BC: tl.constexpr):
    rows, cols, mask, g, u = _tile(GU, N, I, stride_gu, BR, BC)
    dout = tl.load(DOUT + rows[:, None] * stride_do + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    s = tl.sigmoid(g)
    du = dout * g * s
    dg = dout * u * s * (1.0 + g * (1.0 - s))
    to = rows[:, None] * stride_dgu + cols[None, :]
    tl.store(DGU + to, dg.to(DGU.dtype.element_ty), mask=mask)
    tl.store(DGU + to + I, du.to(DGU.dtype.element_ty), mask=mask)


def _rows(x: torch.Tensor) -> torch.Tensor:
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def _grid(N: int, I: int) -> tuple[int, int]:
    return triton.cdiv(N, BR), triton.cdiv(I, BC)


class _SwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gu):
        gu2 = _rows(gu)
        N, I = gu2.shape[0], gu2.shape[1] // 2
        out = torch.empty((N, I), dtype=gu.dtype, device=gu.device)
        if N and I:
            _swiglu_fwd_kernel[_grid(N, I)](gu2, out, N, I, gu2.stride(0), out.stride(0), BR=BR, BC=BC, num_warps=4)
        ctx.save_for_backward(gu2)
        ctx.shape = gu.shape
        return out.view(*gu.shape[:-1], I)

    @staticmethod
    def backward(ctx, dout):
        (gu2,) = ctx.saved_tensors
        N, I = gu2.shape[0], gu2.shape[1] // 2
        do2 = _rows(dout)
        dgu = torch.empty((N, 2 * I), dtype=gu2.dtype, device=gu2.device)
        if N and I:
            _swiglu_bwd_kernel[_grid(N, I)](gu2, do2, dgu, N, I, gu2.stride(0), do2.stride(0), dgu.stride(0), BR=BR,
                                           BC=BC, num_warps=4)
        return dgu.view(ctx.shape)


def swiglu(gu: torch.Tensor) -> torch.Tensor:
    """The Triton backend of `kernels.swiglu`. Under torch.compile the reference twin is traced instead (Inductor
    fuses that chain itself)."""
    if torch.compiler.is_compiling():
        from anyseek.kernels.reference.swiglu import swiglu as reference

        return reference(gu)
    return _SwiGLU.apply(gu)


def available(example: torch.Tensor) -> tuple[bool, str]:
    from anyseek.kernels.triton.check import available as triton_available

    return triton_available(example[..., :1])
