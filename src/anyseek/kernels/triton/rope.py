"""Rotary position embedding in one Triton kernel, in place or not (`kernels.rope_rotate`).

PyTorch's chain for the rope part of MLA's query and key (cast to fp32, complex multiply, back to real, cast, and a
strided copy into place) ran 5-6 kernels per call, each way; here one program reads BLOCK rows (contiguous loads of
each row's rope dims, pairs split in registers), rotates them in fp32 and writes them in the layout asked for. A
first version loaded each pair's halves with two stride-2 loads: 336 us per call at 32k tokens, slower than the
PyTorch chain. Rope widths that are not a power of two go to the reference. Rows are (token, head) pairs with any
strides; the last dim has stride 1. The maths is `kernels.reference.rope`'s.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_ROWS = 32


@triton.jit
def rotate(re, im, c, s):
    """A pair's rotation, (re + i im)(c + i s), in the inputs' precision (fp32 here): -> (re', im')."""
    return re * c - im * s, re * s + im * c


@triton.jit
def _rope_kernel(X, Y, COS, SIN, n_rows, H, sxt, sxh, syt, syh, R2: tl.constexpr, IN_INTER: tl.constexpr,
                 OUT_INTER: tl.constexpr, CONJ: tl.constexpr, BLOCK: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    t, h = rows // H, rows % H
    rmask = rows[:, None] < n_rows
    i = tl.arange(0, R2)
    x_row = X + t[:, None] * sxt + h[:, None] * sxh
    if IN_INTER:  # one contiguous [BLOCK, 2 * R2] load, split into (re, im) pairs in registers
        j = tl.arange(0, 2 * R2)
        x = tl.load(x_row + j[None, :], mask=rmask, other=0.0).to(tl.float32)
        re, im = tl.split(tl.reshape(x, (BLOCK, R2, 2)))
    else:  # two contiguous halves
        re = tl.load(x_row + i[None, :], mask=rmask, other=0.0).to(tl.float32)
        im = tl.load(x_row + R2 + i[None, :], mask=rmask, other=0.0).to(tl.float32)
    c = tl.load(COS + t[:, None] * R2 + i[None, :], mask=rmask, other=0.0)
    s = tl.load(SIN + t[:, None] * R2 + i[None, :], mask=rmask, other=0.0)
    if CONJ:
        s = -s
    out_re, out_im = rotate(re, im, c, s)
    out_re, out_im = out_re.to(Y.dtype.element_ty), out_im.to(Y.dtype.element_ty)
    y_row = Y + t[:, None] * syt + h[:, None] * syh
    if OUT_INTER:
        j = tl.arange(0, 2 * R2)
        tl.store(y_row + j[None, :], tl.reshape(tl.join(out_re, out_im), (BLOCK, 2 * R2)), mask=rmask)
    else:
        tl.store(y_row + i[None, :], out_re, mask=rmask)
        tl.store(y_row + R2 + i[None, :], out_im, mask=rmask)


def rope_rotate(x, cos, sin, out=None, interleaved_in=True, interleaved_out=True, conj=False):
    """As `anyseek.kernels.rope_rotate`."""
    if out is None:
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    x3 = x if x.dim() == 3 else x[:, None, :]
    y3 = out if out.dim() == 3 else out[:, None, :]
    T, H, R = x3.shape
    n_rows = T * H
    if n_rows == 0:
        return out
    if R // 2 & (R // 2 - 1):
        from anyseek.kernels.reference.rope import rope_rotate as reference

        return reference(x, cos, sin, out, interleaved_in, interleaved_out, conj)  # not a power-of-two width
    cos, sin = cos.float().contiguous(), sin.float().contiguous()
    _rope_kernel[(triton.cdiv(n_rows, BLOCK_ROWS),)](
        x3, y3, cos, sin, n_rows, H, x3.stride(0), x3.stride(1), y3.stride(0), y3.stride(1), R2=R // 2,
        IN_INTER=interleaved_in, OUT_INTER=interleaved_out, CONJ=conj, BLOCK=BLOCK_ROWS, num_warps=4,
    )  # fmt: skip
    return out


def available(example: torch.Tensor) -> tuple[bool, str]:
    from anyseek.kernels.triton.check import available as triton_available

    return triton_available(example[..., :1])
