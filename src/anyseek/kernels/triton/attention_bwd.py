"""Triton backward kernels of attention on packed variable-length batches (launched by triton/attention.py).

dq per row tile (keys from the document start to the diagonal), which also computes delta = rowsum(out * dout)
for its rows and keeps it; then dk/dv per key tile (rows from the diagonal to the document end; a program may
walk several heads and sum the shared key part's gradient over them before one fp32 atomic add). Scores are
recomputed from the saved log-sum-exp.
"""

from __future__ import annotations

import triton
import triton.language as tl

from anyseek.kernels.triton.attention_fwd import _load_q_tile, _tile_bounds

# ----------------------------------------------------------------------------------------------------------------
# backward: dk, dv (and the shared part's dk summed over a group of heads)


@triton.jit
def _dkdv_inner(
    dka, dkb, dv, ka, kb, v, Q, DO, LSE, DELTA, q_lo, q_hi, n_idx, doc_end,
    s_qt, s_dot, qk_scale,
    offs_m, offs_a, offs_b, offs_v,
    A: tl.constexpr, B: tl.constexpr, VD: tl.constexpr, HAS_B: tl.constexpr, BLOCK_M: tl.constexpr,
    MASK: tl.constexpr, CAUSAL: tl.constexpr, PREC: tl.constexpr,
):  # fmt: skip
    for q0 in range(q_lo, q_hi, BLOCK_M):
        m_idx = q0 + offs_m
        m_ok = m_idx < doc_end
        qa = tl.load(Q + m_idx[:, None] * s_qt + offs_a[None, :], mask=m_ok[:, None] & (offs_a[None, :] < A), other=0.0)
        sT = tl.dot(ka, tl.trans(qa), input_precision=PREC)  # (BN, BM)
        if HAS_B:
            qb = tl.load(
                Q + A + m_idx[:, None] * s_qt + offs_b[None, :], mask=m_ok[:, None] & (offs_b[None, :] < B), other=0.0
            )
            sT = tl.dot(kb, tl.trans(qb), sT, input_precision=PREC)
        lse = tl.load(LSE + m_idx, mask=m_ok, other=0.0)
        pT = tl.exp2(sT * qk_scale - lse[None, :])
        if MASK:
            keep = m_ok[None, :]
            if CAUSAL:
                keep = keep & (m_idx[None, :] >= n_idx[:, None])
            pT = tl.where(keep, pT, 0.0)
        do = tl.load(
            DO + m_idx[:, None] * s_dot + offs_v[None, :], mask=m_ok[:, None] & (offs_v[None, :] < VD), other=0.0
        )
        dv = tl.dot(pT.to(do.dtype), do, dv, input_precision=PREC)
        delta = tl.load(DELTA + m_idx, mask=m_ok, other=0.0)
        dpT = tl.dot(v, tl.trans(do), input_precision=PREC)
        dsT = (pT * (dpT - delta[None, :])).to(qa.dtype)
        dka = tl.dot(dsT, qa, dka, input_precision=PREC)
        if HAS_B:
            dkb = tl.dot(dsT, qb, dkb, input_precision=PREC)
    return dka, dkb, dv


@triton.jit
def _dkdv_kernel(
    Q, KA, KB, V, DO, LSE, DELTA, DKA, DKB, DV, CU, TILES, n_tiles, T, qk_scale, sm_scale,
    s_qt, s_qh, s_kat, s_kah, s_kbt, s_kbh, s_vt, s_vh, s_dot, s_doh,
    s_dkat, s_dkah, s_dkbt, s_dkbh, s_dvt, s_dvh,
    A: tl.constexpr, B: tl.constexpr, VD: tl.constexpr, HAS_B: tl.constexpr, B_SHARED: tl.constexpr,
    HEADS: tl.constexpr,
    BA: tl.constexpr, BB: tl.constexpr, BV: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr, PREC: tl.constexpr, BIG: tl.constexpr,
):  # fmt: skip
    hg = tl.program_id(0)
    tile = tl.program_id(1)
    doc = tl.load(TILES + tile)
    if doc < 0:
        return
    n_start, doc_start, doc_end = _tile_bounds(TILES, CU, n_tiles, tile, doc, BIG)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_a = tl.arange(0, BA)
    offs_b = tl.arange(0, BB)
    offs_v = tl.arange(0, BV)
    n_idx = n_start + offs_n
    n_ok = n_idx < doc_end
    if CAUSAL:
        q_lo = n_start
        # rows that cross the diagonal (masked): whole row blocks covering the key block
        q_diag = tl.minimum(n_start + ((BLOCK_N + BLOCK_M - 1) // BLOCK_M) * BLOCK_M, doc_end)
    else:
        q_lo = doc_start
        q_diag = doc_start
    q_full = q_diag + ((doc_end - q_diag) // BLOCK_M) * BLOCK_M
    dkb_sum = tl.zeros([BLOCK_N, BB], tl.float32)
    kb = tl.zeros([BLOCK_N, BB], KA.dtype.element_ty)
    if HAS_B and B_SHARED:
        kb = tl.load(
            KB + n_idx[:, None] * s_kbt + offs_b[None, :], mask=n_ok[:, None] & (offs_b[None, :] < B), other=0.0
        )
    for hh in range(HEADS):
        h = hg * HEADS + hh
        ka = tl.load(
            KA + h * s_kah + n_idx[:, None] * s_kat + offs_a[None, :],
            mask=n_ok[:, None] & (offs_a[None, :] < A),
            other=0.0,
        )
        if HAS_B and not B_SHARED:
            kb = tl.load(
                KB + h * s_kbh + n_idx[:, None] * s_kbt + offs_b[None, :],
                mask=n_ok[:, None] & (offs_b[None, :] < B),
                other=0.0,
            )
        v = tl.load(
            V + h * s_vh + n_idx[:, None] * s_vt + offs_v[None, :],
            mask=n_ok[:, None] & (offs_v[None, :] < VD),
            other=0.0,
        )
        dka = tl.zeros([BLOCK_N, BA], tl.float32)
        dkb = tl.zeros([BLOCK_N, BB], tl.float32)
        dv = tl.zeros([BLOCK_N, BV], tl.float32)
        Qh = Q + h * s_qh
        DOh = DO + h * s_doh
        hT = h * T
        if BIG:
            hT = h.to(tl.int64) * T
        LSEh = LSE + hT
        DELTAh = DELTA + hT
        dka, dkb, dv = _dkdv_inner(
            dka, dkb, dv, ka, kb, v, Qh, DOh, LSEh, DELTAh, q_lo, q_diag, n_idx, doc_end, s_qt, s_dot, qk_scale,
            offs_m, offs_a, offs_b, offs_v, A, B, VD, HAS_B, BLOCK_M, True, CAUSAL, PREC,
        )  # fmt: skip
        dka, dkb, dv = _dkdv_inner(
            dka, dkb, dv, ka, kb, v, Qh, DOh, LSEh, DELTAh, q_diag, q_full, n_idx, doc_end, s_qt, s_dot, qk_scale,
            offs_m, offs_a, offs_b, offs_v, A, B, VD, HAS_B, BLOCK_M, False, CAUSAL, PREC,
        )  # fmt: skip
        dka, dkb, dv = _dkdv_inner(
            dka, dkb, dv, ka, kb, v, Qh, DOh, LSEh, DELTAh, q_full, doc_end, n_idx, doc_end, s_qt, s_dot, qk_scale,
            offs_m, offs_a, offs_b, offs_v, A, B, VD, HAS_B, BLOCK_M, True, CAUSAL, PREC,
        )  # fmt: skip
        ptr_a = DKA + h * s_dkah + n_idx[:, None] * s_dkat + offs_a[None, :]
        tl.store(ptr_a, (dka * sm_scale).to(DKA.dtype.element_ty), mask=n_ok[:, None] & (offs_a[None, :] < A))
        ptr_v = DV + h * s_dvh + n_idx[:, None] * s_dvt + offs_v[None, :]
        tl.store(ptr_v, dv.to(DV.dtype.element_ty), mask=n_ok[:, None] & (offs_v[None, :] < VD))
        if HAS_B:
            if B_SHARED:
                dkb_sum += dkb
            else:
                ptr_b = DKB + h * s_dkbh + n_idx[:, None] * s_dkbt + offs_b[None, :]
                tl.store(ptr_b, (dkb * sm_scale).to(DKB.dtype.element_ty), mask=n_ok[:, None] & (offs_b[None, :] < B))
    if HAS_B and B_SHARED:
        ptr_b = DKB + n_idx[:, None] * s_dkbt + offs_b[None, :]
        tl.atomic_add(ptr_b, dkb_sum * sm_scale, mask=n_ok[:, None] & (offs_b[None, :] < B))


# ----------------------------------------------------------------------------------------------------------------
# backward: dq


@triton.jit
def _dq_inner(
    dqa, dqb, qa, qb, do, lse, delta, KA, KB, V, k_lo, k_hi, m_idx, doc_end,
    s_kat, s_kbt, s_vt, qk_scale,
    offs_n, offs_a, offs_b, offs_v,
    A: tl.constexpr, B: tl.constexpr, VD: tl.constexpr, HAS_B: tl.constexpr, BLOCK_N: tl.constexpr,
    MASK: tl.constexpr, CAUSAL: tl.constexpr, PREC: tl.constexpr,
):  # fmt: skip
    for k0 in range(k_lo, k_hi, BLOCK_N):
        n_idx = k0 + offs_n
        n_ok = n_idx < doc_end
        ka = tl.load(
            KA + n_idx[:, None] * s_kat + offs_a[None, :], mask=n_ok[:, None] & (offs_a[None, :] < A), other=0.0
        )
        s = tl.dot(qa, tl.trans(ka), input_precision=PREC)
        kb = ka
        if HAS_B:
            kb = tl.load(
                KB + n_idx[:, None] * s_kbt + offs_b[None, :], mask=n_ok[:, None] & (offs_b[None, :] < B), other=0.0
            )
            s = tl.dot(qb, tl.trans(kb), s, input_precision=PREC)
        p = tl.exp2(s * qk_scale - lse[:, None])
        if MASK:
            keep = n_ok[None, :]
            if CAUSAL:
                keep = keep & (n_idx[None, :] <= m_idx[:, None])
            p = tl.where(keep, p, 0.0)
        v = tl.load(V + n_idx[:, None] * s_vt + offs_v[None, :], mask=n_ok[:, None] & (offs_v[None, :] < VD), other=0.0)
        dp = tl.dot(do, tl.trans(v), input_precision=PREC)
        ds = (p * (dp - delta[:, None])).to(ka.dtype)
        dqa = tl.dot(ds, ka, dqa, input_precision=PREC)
        if HAS_B:
            dqb = tl.dot(ds, kb, dqb, input_precision=PREC)
    return dqa, dqb


@triton.jit
def _dq_kernel(
    Q, KA, KB, V, DO, O, LSE, DELTA, DQ, CU, TILES, n_tiles, T, qk_scale, sm_scale,
    s_qt, s_qh, s_kat, s_kah, s_kbt, s_kbh, s_vt, s_vh, s_dot, s_doh, s_ot, s_oh, s_dqt, s_dqh,
    A: tl.constexpr, B: tl.constexpr, VD: tl.constexpr, HAS_B: tl.constexpr,
    BA: tl.constexpr, BB: tl.constexpr, BV: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr, PREC: tl.constexpr, BIG: tl.constexpr,
):  # fmt: skip
    h = tl.program_id(0)
    tile = tl.program_id(1)
    doc = tl.load(TILES + tile)
    if doc < 0:
        return
    m_start, doc_start, doc_end = _tile_bounds(TILES, CU, n_tiles, tile, doc, BIG)
    hT = h * T
    if BIG:
        hT = h.to(tl.int64) * T
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_a = tl.arange(0, BA)
    offs_b = tl.arange(0, BB)
    offs_v = tl.arange(0, BV)
    m_idx = m_start + offs_m
    m_ok = m_idx < doc_end
    qa, qb = _load_q_tile(Q + h * s_qh, s_qt, m_idx, m_ok, offs_a, offs_b, A, B, HAS_B)
    do = tl.load(
        DO + h * s_doh + m_idx[:, None] * s_dot + offs_v[None, :],
        mask=m_ok[:, None] & (offs_v[None, :] < VD),
        other=0.0,
    )
    lse = tl.load(LSE + hT + m_idx, mask=m_ok, other=0.0)
    # delta = rowsum(out * dout) of these rows, kept for the dk/dv kernel (launched after this one): the row tiles
    # cover every row once
    o = tl.load(
        O + h * s_oh + m_idx[:, None] * s_ot + offs_v[None, :], mask=m_ok[:, None] & (offs_v[None, :] < VD), other=0.0
    )
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    tl.store(DELTA + hT + m_idx, delta, mask=m_ok)
    dqa = tl.zeros([BLOCK_M, BA], tl.float32)
    dqb = tl.zeros([BLOCK_M, BB], tl.float32)
    if CAUSAL:
        k_full = doc_start + ((m_start + 1 - doc_start) // BLOCK_N) * BLOCK_N
        k_end = tl.minimum(m_start + BLOCK_M, doc_end)
    else:
        k_full = doc_start + ((doc_end - doc_start) // BLOCK_N) * BLOCK_N
        k_end = doc_end
    KAh = KA + h * s_kah
    KBh = KB + h * s_kbh
    Vh = V + h * s_vh
    dqa, dqb = _dq_inner(
        dqa, dqb, qa, qb, do, lse, delta, KAh, KBh, Vh, doc_start, k_full, m_idx, doc_end, s_kat, s_kbt, s_vt,
        qk_scale, offs_n, offs_a, offs_b, offs_v, A, B, VD, HAS_B, BLOCK_N, False, CAUSAL, PREC,
    )  # fmt: skip
    dqa, dqb = _dq_inner(
        dqa, dqb, qa, qb, do, lse, delta, KAh, KBh, Vh, k_full, k_end, m_idx, doc_end, s_kat, s_kbt, s_vt,
        qk_scale, offs_n, offs_a, offs_b, offs_v, A, B, VD, HAS_B, BLOCK_N, True, CAUSAL, PREC,
    )  # fmt: skip
    DQh = DQ + h * s_dqh + m_idx[:, None] * s_dqt
    tl.store(
        DQh + offs_a[None, :], (dqa * sm_scale).to(DQ.dtype.element_ty), mask=m_ok[:, None] & (offs_a[None, :] < A)
    )
    if HAS_B:
        tl.store(
            DQh + A + offs_b[None, :],
            (dqb * sm_scale).to(DQ.dtype.element_ty),
            mask=m_ok[:, None] & (offs_b[None, :] < B),
        )
