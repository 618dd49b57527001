"""Triton forward kernel of attention on packed variable-length batches (launched by triton/attention.py).

One program: one head, one tile of BLOCK_M rows of one document. It loops over key blocks from the document's
start up to the causal diagonal (unmasked), then the diagonal / document-end blocks (masked), with an online
softmax in the log2 domain, and writes out and the log-sum-exp. Query/key dims in two parts A + B (see
attention.py); part B's key may be shared by all heads (head stride 0).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _tile_bounds(TILES, CU, n_tiles, tile, doc, BIG: tl.constexpr):
    """First row of a (non-idle) tile of the schedule and its document's [start, end)."""
    start = tl.load(TILES + n_tiles + tile)
    doc_start = tl.load(CU + doc)
    doc_end = tl.load(CU + doc + 1)
    if BIG:  # offsets past 2**31 elements: 64-bit row indices (slower address math, so only when needed)
        start = start.to(tl.int64)
        doc_start = doc_start.to(tl.int64)
        doc_end = doc_end.to(tl.int64)
    return start, doc_start, doc_end


@triton.jit
def _load_q_tile(Qh, s_qt, m_idx, m_ok, offs_a, offs_b, A: tl.constexpr, B: tl.constexpr, HAS_B: tl.constexpr):
    """A tile of one head's queries, split into its first A and (when HAS_B) next B columns; qb = qa without B."""
    qa = tl.load(Qh + m_idx[:, None] * s_qt + offs_a[None, :], mask=m_ok[:, None] & (offs_a[None, :] < A), other=0.0)
    qb = qa
    if HAS_B:
        qb = tl.load(
            Qh + A + m_idx[:, None] * s_qt + offs_b[None, :], mask=m_ok[:, None] & (offs_b[None, :] < B), other=0.0
        )
    return qa, qb


@triton.jit
def _fwd_inner(
    acc, l_i, m_i, qa, qb, KA, KB, V, k_lo, k_hi, m_idx, doc_end,
    s_kat, s_kbt, s_vt, qk_scale,
    offs_n, offs_a, offs_b, offs_v,
    A: tl.constexpr, B: tl.constexpr, VD: tl.constexpr, HAS_B: tl.constexpr, BLOCK_N: tl.constexpr,
    MASK: tl.constexpr, CAUSAL: tl.constexpr, PREC: tl.constexpr,
):  # fmt: skip
    for k0 in range(k_lo, k_hi, BLOCK_N):
        n_idx = k0 + offs_n
        n_ok = n_idx < doc_end
        ka = tl.load(
            KA + n_idx[None, :] * s_kat + offs_a[:, None], mask=n_ok[None, :] & (offs_a[:, None] < A), other=0.0
        )
        s = tl.dot(qa, ka, input_precision=PREC)
        if HAS_B:
            kb = tl.load(
                KB + n_idx[None, :] * s_kbt + offs_b[:, None], mask=n_ok[None, :] & (offs_b[:, None] < B), other=0.0
            )
            s = tl.dot(qb, kb, s, input_precision=PREC)
        if MASK:
            keep = n_ok[None, :]
            if CAUSAL:
                keep = keep & (n_idx[None, :] <= m_idx[:, None])
            s = tl.where(keep, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
        p = tl.exp2(s * qk_scale - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(V + n_idx[:, None] * s_vt + offs_v[None, :], mask=n_ok[:, None] & (offs_v[None, :] < VD), other=0.0)
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=PREC)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _fwd_kernel(
    Q, KA, KB, V, O, LSE, CU, TILES, n_tiles, T, qk_scale,
    s_qt, s_qh, s_kat, s_kah, s_kbt, s_kbh, s_vt, s_vh, s_ot, s_oh,
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
    KAh = KA + h * s_kah
    KBh = KB + h * s_kbh
    Vh = V + h * s_vh
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BV], tl.float32)
    if CAUSAL:
        # keys strictly below the block's first row need no mask: whole blocks up to m_start + 1
        k_full = doc_start + ((m_start + 1 - doc_start) // BLOCK_N) * BLOCK_N
        k_end = tl.minimum(m_start + BLOCK_M, doc_end)
    else:
        k_full = doc_start + ((doc_end - doc_start) // BLOCK_N) * BLOCK_N
        k_end = doc_end
    acc, l_i, m_i = _fwd_inner(
        acc, l_i, m_i, qa, qb, KAh, KBh, Vh, doc_start, k_full, m_idx, doc_end, s_kat, s_kbt, s_vt, qk_scale,
        offs_n, offs_a, offs_b, offs_v, A, B, VD, HAS_B, BLOCK_N, False, CAUSAL, PREC,
    )  # fmt: skip
    acc, l_i, m_i = _fwd_inner(
        acc, l_i, m_i, qa, qb, KAh, KBh, Vh, k_full, k_end, m_idx, doc_end, s_kat, s_kbt, s_vt, qk_scale,
        offs_n, offs_a, offs_b, offs_v, A, B, VD, HAS_B, BLOCK_N, True, CAUSAL, PREC,
    )  # fmt: skip
    out = acc / l_i[:, None]
    o_ptr = O + h * s_oh + m_idx[:, None] * s_ot + offs_v[None, :]
    tl.store(o_ptr, out.to(O.dtype.element_ty), mask=m_ok[:, None] & (offs_v[None, :] < VD))
    tl.store(LSE + hT + m_idx, m_i + tl.log2(l_i), mask=m_ok)
