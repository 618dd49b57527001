"""Fused RMSNorm, forward and backward, in Triton: one kernel each way instead of PyTorch's chain (cast to fp32,
normalise, cast back, scale; and their backwards plus the weight-gradient reduction).

The maths is `kernels.reference.norm.rms_norm`'s: y = x * rsqrt(mean(x^2) + eps) in fp32, rounded to x's dtype,
times the weight, output in the promotion of x's and weight's dtypes. The backward treats the rounding as the identity
(as autograd does a cast): dx = rstd * (dy - xhat * mean(dy * xhat)), dy = dout * w, dw = sum over rows of
dout * y. Row r's rstd is kept from the forward ([N] fp32). dw: each backward program sums its rows in fp32 into
one partial row; the partials are summed once in torch.

Shape legend: N rows (all leading dims), D the normalised dim, BD its power-of-two block, P backward programs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rmsnorm_fwd_kernel(X, W, Y, RSTD, stride_x, stride_y, D, eps, BD: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BD)
    mask = cols < D
    x_raw = tl.load(X + row * stride_x + cols, mask=mask, other=0.0)
    x = x_raw.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / D + eps)
    y = (x * rstd).to(x_raw.dtype).to(tl.float32)  # rounded to x's dtype before the scale, as the reference
    w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(Y + row * stride_y + cols, (w * y).to(Y.dtype.element_ty), mask=mask)
    tl.store(RSTD + row, rstd)


@triton.jit
def _rmsnorm_bwd_kernel(DOUT, X, W, RSTD, DX, DW_PART, stride_do, stride_x, stride_dx, N, D, rows_per_program,
                BD: tl.constexpr):
    pid = tl.program_id(0)
    cols = tl.arange(0, BD)
    mask = cols < D
    w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    dw = tl.zeros((BD,), dtype=tl.float32)
    start = pid * rows_per_program
    for i in range(0, rows_per_program):
        row = (start + i).to(tl.int64)
        if row < N:
            x_raw = tl.load(X + row * stride_x + cols, mask=mask, other=0.0)
            x = x_raw.to(tl.float32)
            dout = tl.load(DOUT + row * stride_do + cols, mask=mask, other=0.0).to(tl.float32)
            rstd = tl.load(RSTD + row)
            xhat = x * rstd
            dw += dout * xhat.to(x_raw.dtype).to(tl.float32)
            dy = dout * w
            c = tl.sum(dy * xhat, axis=0) / D
            tl.store(DX + row * stride_dx + cols, ((dy - xhat * c) * rstd).to(DX.dtype.element_ty), mask=mask)
    tl.store(DW_PART + pid * D + cols, dw, mask=mask)


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x [..., D] as [N, D] with unit column stride (a view where possible)."""
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def _num_programs(n: int, device: torch.device) -> int:
    if device.type == "cuda":
        return max(1, min(n, 4 * torch.cuda.get_device_properties(device).multi_processor_count))
    return max(1, min(n, 4))  # the interpreter: few programs


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps: float):
        D = x.shape[-1]
        x2 = _rows(x)
        N = x2.shape[0]
        y = torch.empty((N, D), dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
        rstd = torch.empty(N, dtype=torch.float32, device=x.device)
        BD = triton.next_power_of_2(D)
        if N:
            _rmsnorm_fwd_kernel[(N,)](x2, weight, y, rstd, x2.stride(0), y.stride(0), D, eps, BD=BD,
                              num_warps=min(16, max(1, BD // 256)))
        ctx.save_for_backward(x2, weight, rstd)
        ctx.x_shape = x.shape
        return y.view(*x.shape[:-1], D)

    @staticmethod
    def backward(ctx, dout):
        x2, weight, rstd = ctx.saved_tensors
        N, D = x2.shape
        do2 = _rows(dout)
        dx = torch.empty((N, D), dtype=x2.dtype, device=x2.device)
        P = _num_programs(N, x2.device)
        rows_per_program = triton.cdiv(N, P) if N else 0
        dw_part = torch.zeros((P, D), dtype=torch.float32, device=x2.device)
        BD = triton.next_power_of_2(D)
        if N:
            _rmsnorm_bwd_kernel[(P,)](do2, x2, weight, rstd, dx, dw_part, do2.stride(0), x2.stride(0), dx.stride(0), N, D,
                              rows_per_program, BD=BD, num_warps=min(16, max(1, BD // 256)))
        dw = dw_part.sum(0).to(weight.dtype)
        return dx.view(ctx.x_shape), dw, None


def rms_norm(x: torch.Tensor, weight_D: torch.Tensor, eps: float) -> torch.Tensor:
    """The Triton backend of `kernels.rms_norm` (see the module docstring). Under torch.compile the reference twin is
    traced instead: Inductor fuses that chain itself, and the autograd.Function launching raw Triton kernels does not
    trace with dynamic shapes."""
    if torch.compiler.is_compiling():
        from anyseek.kernels.reference.norm import rms_norm as reference

        return reference(x, weight_D, eps)
    return _RMSNorm.apply(x, weight_D, eps)


def available(example: torch.Tensor) -> tuple[bool, str]:
    """(ok, reason) for the fused RMSNorm on tensors like `example`."""
    from anyseek.kernels.triton.check import available as triton_available

    ok, reason = triton_available(example[..., :1])  # the head-dim limit of attention does not apply
    if not ok:
        return ok, reason
    if example.shape[-1] > 16384:
        return False, f"normalised dim {example.shape[-1]} > 16384 (one row per program)"
    return True, reason.replace("kernel", "fused RMSNorm")
