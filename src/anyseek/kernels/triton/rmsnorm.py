"""Fused RMSNorm, forward and backward, in Triton: one kernel each way instead of PyTorch's chain (cast to fp32,
normalise, cast back, scale; and their backwards plus the weight-gradient reduction).

The maths is `kernels.reference.norm.rms_norm`'s: y = x * rsqrt(mean(x^2) + eps) in fp32, rounded to x's dtype,
times the weight, output in the promotion of x's and weight's dtypes. The backward treats the rounding as the identity
(as autograd does a cast): dx = rstd * (dy - xhat * mean(dy * xhat)), dy = dout * w, dw = sum over rows of
dout * y. Row r's rstd is kept from the forward ([N] fp32). dw: each backward program sums its rows in fp32 into
one partial row; the partials are summed once in torch.

`add_rms_norm` is the same with the residual add in front (h = x + y rounded to h's dtype, then the norm of h): the
forward writes h and the normalised h in one pass, and the backward adds the residual's own gradient dh into dx
(which is then the gradient of both x and y), so neither the add nor the sum of the two gradients is a kernel of
its own.

Shape legend: N rows (all leading dims), D the normalised dim, BD its power-of-two block, P backward programs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rmsnorm_fwd_kernel(X, R, H, W, Y, RSTD, stride_x, stride_r, stride_h, stride_y, D, eps, HAS_RES: tl.constexpr,
                        BD: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BD)
    mask = cols < D
    x_raw = tl.load(X + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RES:  # h = x + y, rounded to h's dtype: the residual stream as an unfused add would leave it
        r = tl.load(R + row * stride_r + cols, mask=mask, other=0.0)
        x_raw = (x_raw.to(tl.float32) + r.to(tl.float32)).to(H.dtype.element_ty)
        tl.store(H + row * stride_h + cols, x_raw, mask=mask)
    x = x_raw.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / D + eps)
    y = (x * rstd).to(x_raw.dtype).to(tl.float32)  # rounded to x's dtype before the scale, as the reference
    w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(Y + row * stride_y + cols, (w * y).to(Y.dtype.element_ty), mask=mask)
    tl.store(RSTD + row, rstd)


@triton.jit
def _rmsnorm_bwd_kernel(DOUT, DOUT2, DOUT3, X, W, RSTD, DH, DX, DW_PART, stride_do, stride_do2, stride_do3, stride_x,
                        stride_dh, stride_dx, N, D, rows_per_program, N_DOUT: tl.constexpr, HAS_DH: tl.constexpr,
                        HAS_DW: tl.constexpr, BD: tl.constexpr, BR: tl.constexpr):
    """Program pid: rows [pid * rows_per_program, +rows_per_program), BR rows at a time (several rows' loads in
    flight: one row per iteration left the kernel latency-bound at twice its memory time on an H100). N_DOUT (1-3):
    the output's gradients to sum first (one per copy of the output, `add_rms_norm(copies=)`). HAS_DW: write this
    program's partial weight gradient (off for a frozen weight, as under LoRA)."""
    pid = tl.program_id(0)
    cols = tl.arange(0, BD)
    mask = cols < D
    w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    dw = tl.zeros((BR, BD), dtype=tl.float32)
    start = pid * rows_per_program
    end = tl.minimum(start + rows_per_program, N)
    for r0 in range(start, end, BR):
        rows = r0 + tl.arange(0, BR)
        rmask = rows < end
        m2 = rmask[:, None] & mask[None, :]
        rows64 = rows.to(tl.int64)[:, None]
        x_raw = tl.load(X + rows64 * stride_x + cols[None, :], mask=m2, other=0.0)
        x = x_raw.to(tl.float32)
        dout = tl.load(DOUT + rows64 * stride_do + cols[None, :], mask=m2, other=0.0).to(tl.float32)
        if N_DOUT > 1:  # the copies' gradients, summed in fp32 (what autograd would add in bf16, pass by pass)
            dout += tl.load(DOUT2 + rows64 * stride_do2 + cols[None, :], mask=m2, other=0.0).to(tl.float32)
        if N_DOUT > 2:
            dout += tl.load(DOUT3 + rows64 * stride_do3 + cols[None, :], mask=m2, other=0.0).to(tl.float32)
        rstd = tl.load(RSTD + rows, mask=rmask, other=0.0)[:, None]
        xhat = x * rstd
        if HAS_DW:
            dw += dout * xhat.to(x_raw.dtype).to(tl.float32)
        dy = dout * w[None, :]
        c = tl.sum(dy * xhat, axis=1)[:, None] / D
        dx = (dy - xhat * c) * rstd
        if HAS_DH:  # the residual's own gradient: the sum autograd would otherwise make
            dx += tl.load(DH + rows64 * stride_dh + cols[None, :], mask=m2, other=0.0).to(tl.float32)
        tl.store(DX + rows64 * stride_dx + cols[None, :], dx.to(DX.dtype.element_ty), mask=m2)
    if HAS_DW:
        tl.store(DW_PART + pid * D + cols, tl.sum(dw, axis=0), mask=mask)


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x [..., D] as [N, D] with unit column stride (a view where possible)."""
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def _num_programs(n: int, device: torch.device) -> int:
    if device.type == "cuda":
        return max(1, min(n, 4 * torch.cuda.get_device_properties(device).multi_processor_count))
    return max(1, min(n, 4))  # the interpreter: few programs


def _forward(x2, r2, weight, eps, h_dtype):
    """(h or None, y, rstd) for rows x2 (+ r2 when given)."""
    N, D = x2.shape
    y = torch.empty((N, D), dtype=torch.promote_types(h_dtype, weight.dtype), device=x2.device)
    rstd = torch.empty(N, dtype=torch.float32, device=x2.device)
    h = torch.empty((N, D), dtype=h_dtype, device=x2.device) if r2 is not None else None
    BD = triton.next_power_of_2(D)
    if N:
        _rmsnorm_fwd_kernel[(N,)](
            x2, r2 if r2 is not None else x2, h if h is not None else x2, weight, y, rstd, x2.stride(0),
            r2.stride(0) if r2 is not None else 0, D if h is not None else 0, y.stride(0), D, eps,
            HAS_RES=r2 is not None, BD=BD, num_warps=min(16, max(1, BD // 256)),
        )  # fmt: skip
    return h, y, rstd


def _backward(douts, x2, weight, rstd, dh, want_dw=True):
    """(dx [N, D] in x2's dtype, with dh added when given; dw in weight's dtype, None unless want_dw) for the output
    gradient sum(douts) (1-3 tensors, summed inside the kernel). Without want_dw no partials are written or summed
    (a frozen norm weight: the partials' sum was 13 us per norm on an H100, 32 norms a step of `small`)."""
    N, D = x2.shape
    do = [_rows(d) for d in douts]
    do3 = do + [do[0]] * (3 - len(do))
    dh2 = _rows(dh) if dh is not None else None
    dx = torch.empty((N, D), dtype=x2.dtype, device=x2.device)
    P = _num_programs(N, x2.device)
    rows_per_program = triton.cdiv(N, P) if N else 0
    dw_part = torch.zeros((P, D), dtype=torch.float32, device=x2.device) if want_dw else None
    BD = triton.next_power_of_2(D)
    BR = max(1, min(16, 4096 // BD))  # a [BR, BD] tile of ~4K elements per step
    if N:
        _rmsnorm_bwd_kernel[(P,)](
            *do3, x2, weight, rstd, dh2 if dh2 is not None else do3[0], dx, dw_part if want_dw else dx,
            *(d.stride(0) for d in do3),
            x2.stride(0), dh2.stride(0) if dh2 is not None else 0, dx.stride(0), N, D, rows_per_program,
            N_DOUT=len(do), HAS_DH=dh2 is not None, HAS_DW=want_dw, BD=BD, BR=BR,
            num_warps=min(16, max(4, BR * BD // 512)),
        )  # fmt: skip
    return dx, dw_part.sum(0).to(weight.dtype) if want_dw else None


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps: float):
        x2 = _rows(x)
        _, y, rstd = _forward(x2, None, weight, eps, x.dtype)
        ctx.save_for_backward(x2, weight, rstd)
        ctx.x_shape = x.shape
        return y.view(*x.shape[:-1], x.shape[-1])

    @staticmethod
    def backward(ctx, dout):
        x2, weight, rstd = ctx.saved_tensors
        dx, dw = _backward([dout], x2, weight, rstd, None, want_dw=ctx.needs_input_grad[1])
        return dx.view(ctx.x_shape), dw, None


class _AddRMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, y, weight, eps: float, copies: int):
        h_dtype = torch.promote_types(x.dtype, y.dtype)
        h, out, rstd = _forward(_rows(x), _rows(y), weight, eps, h_dtype)
        ctx.save_for_backward(h, weight, rstd)
        ctx.shape, ctx.dtypes = x.shape, (x.dtype, y.dtype)
        ctx.set_materialize_grads(False)  # an unused output's gradient stays None (no zero tensor to add)
        out = out.view(x.shape)
        return h.view(x.shape), out, *(out.view_as(out) for _ in range(copies - 1))

    @staticmethod
    def backward(ctx, dh, *douts):
        h, weight, rstd = ctx.saved_tensors
        douts = [d for d in douts if d is not None]
        if not douts:  # only h was used: the add's backward
            dx, dw = dh, None
        else:
            dx, dw = _backward(douts, h, weight, rstd, dh, want_dw=ctx.needs_input_grad[2])
            dx = dx.view(ctx.shape)
        return dx.to(ctx.dtypes[0]), dx.to(ctx.dtypes[1]), dw, None, None


def rms_norm(x: torch.Tensor, weight_D: torch.Tensor, eps: float) -> torch.Tensor:
    """The Triton backend of `kernels.rms_norm` (see the module docstring). Under torch.compile the reference twin is
    traced instead: Inductor fuses that chain itself, and the autograd.Function launching raw Triton kernels does not
    trace with dynamic shapes."""
    if torch.compiler.is_compiling():
        from anyseek.kernels.reference.norm import rms_norm as reference

        return reference(x, weight_D, eps)
    return _RMSNorm.apply(x, weight_D, eps)


def add_rms_norm(x: torch.Tensor, y: torch.Tensor, weight_D: torch.Tensor, eps: float, copies: int = 1
                 ) -> tuple[torch.Tensor, ...]:
    """The Triton backend of `kernels.add_rms_norm` (see the module docstring): (h, out, and copies - 1 more views
    of out, whose gradients the backward sums in its own pass); the reference twin under torch.compile, as
    `rms_norm`."""
    if not 1 <= copies <= 3:
        raise ValueError(f"add_rms_norm: copies must be 1, 2 or 3, got {copies}")
    if torch.compiler.is_compiling():
        from anyseek.kernels.reference.norm import add_rms_norm as reference

        return reference(x, y, weight_D, eps, copies)
    return _AddRMSNorm.apply(x, y, weight_D, eps, copies)


def available(example: torch.Tensor) -> tuple[bool, str]:
    """(ok, reason) for the fused RMSNorm on tensors like `example`."""
    from anyseek.kernels.triton.check import available as triton_available

    ok, reason = triton_available(example[..., :1])  # the head-dim limit of attention does not apply
    if not ok:
        return ok, reason
    if example.shape[-1] > 16384:
        return False, f"normalised dim {example.shape[-1]} > 16384 (one row per program)"
    return True, reason.replace("kernel", "fused RMSNorm")
