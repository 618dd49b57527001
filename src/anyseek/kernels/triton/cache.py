"""The latent-cache write of a decode step in one Triton kernel (`kernels.mla_cache_write`): per new token, the
RMSNorm of its latent and the rotary embedding of its k_pe, stored straight into its cache row, and (given the
query's rope part) the rotation of the query's H heads with the same cos/sin. The decode step ran five kernels for
it per layer (the norm, two ropes, a concatenation, an index copy), each a launch-bound few microseconds at
decoding's few rows. The maths is `kernels.reference.cache`'s (the norm as `triton/rmsnorm.py`'s,
the rotation as `triton/rope.py`'s); where the dtypes would round differently than that twin, the twin runs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from anyseek.kernels.triton.rope import rotate


@triton.jit
def _cache_write_kernel(KV, W, COS, SIN, SLOTS, OUT, Q, QO, stride_kv, stride_out, sqt, sqh, sot, soh, H, L, eps,
                        BL: tl.constexpr, R2: tl.constexpr, IN_INTER: tl.constexpr, Q_ROPE: tl.constexpr,
                        BH: tl.constexpr):  # fmt: skip
    t = tl.program_id(0).to(tl.int64)
    kv = KV + t * stride_kv
    row = OUT + tl.load(SLOTS + t).to(tl.int64) * stride_out
    cols = tl.arange(0, BL)
    mask = cols < L
    x_raw = tl.load(kv + cols, mask=mask, other=0.0)
    x = x_raw.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / L + eps)
    y = (x * rstd).to(x_raw.dtype).to(tl.float32)  # rounded to x's dtype before the scale, as the reference
    w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(row + cols, (w * y).to(OUT.dtype.element_ty), mask=mask)
    i = tl.arange(0, R2)
    if IN_INTER:  # (re, im) pairs side by side
        j = tl.arange(0, 2 * R2)
        re, im = tl.split(tl.reshape(tl.load(kv + L + j).to(tl.float32), (R2, 2)))
    else:  # two halves
        re = tl.load(kv + L + i).to(tl.float32)
        im = tl.load(kv + L + R2 + i).to(tl.float32)
    c = tl.load(COS + t * R2 + i)
    s = tl.load(SIN + t * R2 + i)
    out_re, out_im = rotate(re, im, c, s)
    out_re, out_im = out_re.to(OUT.dtype.element_ty), out_im.to(OUT.dtype.element_ty)
    j = tl.arange(0, 2 * R2)
    tl.store(row + L + j, tl.reshape(tl.join(out_re, out_im), (2 * R2,)))  # interleaved, as rope_rotate writes
    if Q_ROPE:  # the query's heads, as `triton/rope.py` rotates them (fp32, then the output's dtype)
        h = tl.arange(0, BH)
        hmask = (h < H)[:, None]
        q_row = Q + t * sqt + h[:, None].to(tl.int64) * sqh
        if IN_INTER:
            q = tl.load(q_row + j[None, :], mask=hmask, other=0.0).to(tl.float32)
            q_re, q_im = tl.split(tl.reshape(q, (BH, R2, 2)))
        else:
            q_re = tl.load(q_row + i[None, :], mask=hmask, other=0.0).to(tl.float32)
            q_im = tl.load(q_row + R2 + i[None, :], mask=hmask, other=0.0).to(tl.float32)
        o_re, o_im = rotate(q_re, q_im, c[None, :], s[None, :])
        o_re, o_im = o_re.to(QO.dtype.element_ty), o_im.to(QO.dtype.element_ty)
        o_row = QO + t * sot + h[:, None].to(tl.int64) * soh
        tl.store(o_row + j[None, :], tl.reshape(tl.join(o_re, o_im), (BH, 2 * R2)), mask=hmask)


def mla_cache_write(cache_NX, slots_T, kv_a_TX, weight_L, eps, cos, sin, interleaved_in, q_pe_THR=None,
                    q_out_THR=None):  # fmt: skip
    """As `anyseek.kernels.mla_cache_write`."""
    T, L = kv_a_TX.shape[0], weight_L.shape[0]
    R = kv_a_TX.shape[1] - L
    same = kv_a_TX.dtype == cache_NX.dtype == torch.promote_types(kv_a_TX.dtype, weight_L.dtype)
    if not same or R // 2 & (R // 2 - 1):  # other roundings, or a rope width that is not a power of two
        from anyseek.kernels.reference.cache import mla_cache_write as reference

        return reference(cache_NX, slots_T, kv_a_TX, weight_L, eps, cos, sin, interleaved_in, q_pe_THR, q_out_THR)
    if T == 0:
        return None
    cos, sin = cos.float().contiguous(), sin.float().contiguous()
    BL = triton.next_power_of_2(L)
    q = q_pe_THR is not None
    qi, qo = (q_pe_THR, q_out_THR) if q else (kv_a_TX, kv_a_TX)  # (unread without the query)
    H = q_pe_THR.shape[1] if q else 1
    _cache_write_kernel[(T,)](kv_a_TX, weight_L, cos, sin, slots_T, cache_NX, qi, qo, kv_a_TX.stride(0),
                              cache_NX.stride(0), qi.stride(0), qi.stride(1) if q else 0, qo.stride(0),
                              qo.stride(1) if q else 0, H, L, eps, BL=BL, R2=R // 2, IN_INTER=interleaved_in,
                              Q_ROPE=q, BH=triton.next_power_of_2(H), num_warps=min(8, max(1, BL // 256)))  # fmt: skip
    return None


def available(example: torch.Tensor) -> tuple[bool, str]:
    from anyseek.kernels.triton.check import available as triton_available

    return triton_available(example[..., :1])
