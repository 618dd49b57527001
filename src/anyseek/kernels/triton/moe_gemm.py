"""Triton kernels of the routed experts: one grouped GEMM over expert-major rows (with three epilogues) and one
grouped weight-gradient GEMM. Launchers live in `moe.py`, autograd in `kernels/ops/moe.py`.

Rows are the T*K routed (token, k) slots sorted by expert (stable): expert e owns rows offs[e]:offs[e+1]. A row
knows its token (tok[r] = slot // K, to gather x or dy without a permuted copy) and its slot (slot[r] = t*K + k, to
read its routing weight and to scatter outputs back to token order without atomics).

`_grouped_gemm_kernel`: C[r] = A[row(r)] @ B_e for the rows r of expert e. One program per (row tile, column tile);
row tiles never straddle two experts and come from a device-side map (tile -> expert, first row) whose length is a
host-computable upper bound, cdiv(M, BLOCK_M) + E; unused map slots hold expert -1 and exit at once. So the launch
grid depends on M and E only, never on the per-expert counts: no host sync, no recompiles, CUDA-graph safe.
B_e is read through strides, so nn.Linear weights serve as B or B^T without a copy. Epilogues (EPI):
  0  plain store (optionally to row slot[r]: the scatter back to token order);
  1  SwiGLU forward: two accumulators over the gate columns j and the up columns I + j of the same weight,
     act = silu(g) * u * w[slot] (the routing weight applied on the narrow side); optionally stores h = [g, u];
  2  SwiGLU backward: the accumulator is d(act*w); with the saved h it writes dh = [dg, du] and the partial
     routing-weight gradient sum_j act * d(act*w) of this column tile (summed over tiles on the host side,
     in a fixed order: deterministic).
With LORA, a rank-r term joins the accumulator(s) before the epilogue: C[r] = A[row(r)] @ (B_e + P_e R_e), the
effective weight of a LoRA expert (W_e + B_e A_e) without forming it (moe.py). The loop over K also accumulates
L = A[row(r)] @ P_e [BM, r] (r/BN more MMA work: each column tile computes its own); the epilogue adds L @ R_e, and
the first column tile stores L (row order) for the weight gradients. L_MODE 1 (gathered A rows: A is per token): the
loop has no second dot; L is loaded (before the loop, added in the epilogue) from a [T, E*r] product of every token
with every expert's P, made beforehand by one dense matmul (the rows' own r columns of their token's row).
L_MODE 2: L is loaded in row order, made beforehand by this kernel with N = r (A @ P_e alone: one narrow pass).

`_grouped_wgrad_kernel`: dW_e = A_e^T @ B_e, the reduction running over the rows of expert e (a loop whose
bounds are read from offs on the device). Empty experts get zeros.

With QUANT, B_e is a 4-bit packed weight (`kernels/reference/quant4.py`: uint8 rows of codes and bf16 scales, read
through `s_ptr`, an int16 view of the same bytes, and the NF4 levels `lut_ptr`), dequantized tile by tile in the loop
over K (`quant4_dq.py`: each code byte loaded once, one scale per row and group; Q_DQ the lookup form, 0 the legacy
element-wise one); Q_K_IN: the loop runs over the weight's input dim (forward), else its output dim (backward).
A LoRA expert's frozen stacks in 4 bits (`quant4_moe.py`); everything else as above.

Shape legend: M routed rows, K_red the reduction length, N output columns, E experts, BM/BN/BK tile sizes.
"""

from __future__ import annotations

import triton
import triton.language as tl

from anyseek.kernels.triton.quant4_dq import dq_rows, dq_tile

EPI_PLAIN, EPI_SWIGLU, EPI_DSWIGLU = 0, 1, 2


@triton.jit
def _tile_of(pid, n_tiles_m, n_tiles_n, GROUP_M: tl.constexpr):
    """(row tile, column tile) of program pid, GROUP_M row tiles side by side so that neighbours share B tiles."""
    width = GROUP_M * n_tiles_n
    first_m = (pid // width) * GROUP_M
    size_m = tl.minimum(n_tiles_m - first_m, GROUP_M)
    pid_m = first_m + (pid % width) % size_m
    pid_n = (pid % width) // size_m
    return pid_m, pid_n


@triton.jit
def _r_ptrs(r_ptr, e, kr, cols_c, stride_re, stride_rk, stride_rn):
    """R_e's [RANK, BLOCK_N] tile of the LoRA term (rows past the rank masked by the caller)."""
    return r_ptr + e.to(tl.int64) * stride_re + kr[:, None] * stride_rk + cols_c[None, :].to(tl.int64) * stride_rn


@triton.jit
def _grouped_gemm_kernel(
    a_ptr, tok_ptr, slot_ptr, b_ptr, c_ptr, h_ptr, w_ptr, dw_ptr,
    offs_ptr, tile_expert_ptr, tile_row_ptr,
    n_tiles_m, N, K_red,
    stride_am, stride_be, stride_bk, stride_bn, stride_cm, stride_hm, up_cols,
    l_ptr, p_ptr, r_ptr, stride_lm, stride_pe, stride_pk, stride_pn, stride_re, stride_rk, stride_rn, rank,
    s_ptr, lut_ptr, q_row, q_scale_at,
    GATHER_A: tl.constexpr, SCATTER_C: tl.constexpr, EPI: tl.constexpr, SAVE_H: tl.constexpr,
    EVEN_K: tl.constexpr, EVEN_N: tl.constexpr, LORA: tl.constexpr, L_MODE: tl.constexpr, RANK: tl.constexpr,
    PREC: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    QUANT: tl.constexpr = False, Q_K_IN: tl.constexpr = False, Q_GROUP: tl.constexpr = 64, Q_DQ: tl.constexpr = 4,
):  # fmt: skip
    pid_m, pid_n = _tile_of(tl.program_id(0), n_tiles_m, tl.cdiv(N, BLOCK_N), GROUP_M)
    e = tl.load(tile_expert_ptr + pid_m)
    if e < 0:
        return
    row0 = tl.load(tile_row_ptr + pid_m)
    row_end = tl.load(offs_ptr + e + 1)
    rows = row0 + tl.arange(0, BLOCK_M)
    rmask = rows < row_end
    rows_c = tl.minimum(rows, row_end - 1)  # clamped: A loads need no row mask (a tile holds >= 1 valid row)
    if GATHER_A:
        a_rows = tl.load(tok_ptr + rows_c).to(tl.int64)
    else:
        a_rows = rows_c.to(tl.int64)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    cmask = cols < N
    cols_c = cols % N  # wrapped: B loads need no col mask
    if EVEN_N:  # (a wrapped tile is not contiguous: the hint only where no tile wraps)
        cols_c = tl.max_contiguous(tl.multiple_of(cols_c, BLOCK_N), BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + a_rows[:, None] * stride_am + ks[None, :]
    b_ptrs = (b_ptr + e.to(tl.int64) * stride_be) + (ks[:, None] * stride_bk + cols_c[None, :] * stride_bn)  # 32-bit
    # offsets within expert e's weight (as for C below: 64-bit pointers per element cost registers)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    kr = tl.arange(0, RANK)
    acc_l = tl.zeros((BLOCK_M, RANK), dtype=tl.float32)
    lmask = rmask[:, None] & (kr < rank)[None, :]
    if LORA and L_MODE != 0:  # L and R_e loaded before the loop, their latency hidden under it (these tiles run one
        # program per SM or two: loaded in the epilogue, they stalled every tile; Triton keeps them in shared memory)
        if L_MODE == 1:  # given per token for every expert: p_ptr [T, E * r] (row stride stride_pk), columns e*r..
            l_early = tl.load(p_ptr + a_rows[:, None] * stride_pk + (e * rank + kr)[None, :], mask=lmask, other=0.0)
        else:  # given in row order (l_ptr), made by a narrow launch of this kernel beforehand
            l_early = tl.load(l_ptr + rows.to(tl.int64)[:, None] * stride_lm + kr[None, :], mask=lmask, other=0.0)
        r_ptrs = _r_ptrs(r_ptr, e, kr, cols_c, stride_re, stride_rk, stride_rn)
        r_early = tl.load(r_ptrs, mask=(kr < rank)[:, None], other=0.0)
        if EPI == 1:
            r_u_early = tl.load(r_ptrs + up_cols * stride_rn, mask=(kr < rank)[:, None], other=0.0)
    if LORA and L_MODE == 0:  # P_e [K_red, r]; columns past r wrap (duplicates, cancelled by R's zero rows past r)
        p_ptrs = p_ptr + e.to(tl.int64) * stride_pe + ks[:, None] * stride_pk + (kr % rank)[None, :] * stride_pn
    if QUANT:  # B_e is expert e's packed 4-bit weight (bytes: stride_be per expert), dequantized tile by tile
        q_e = b_ptr + e.to(tl.int64) * stride_be
        s_e = s_ptr + e.to(tl.int64) * (stride_be // 2)
    for k in range(tl.cdiv(K_red, BLOCK_K)):
        if EVEN_K:
            a = tl.load(a_ptrs)
        else:
            kmask = ks < K_red - k * BLOCK_K
            a = tl.load(a_ptrs, mask=kmask[None, :], other=0.0)
        if QUANT:
            kk = k * BLOCK_K + ks
            if Q_DQ == 0:  # the legacy element-wise dequantization (benchmarks/quant4_gemm.py's before)
                qmask = (kk < K_red)[:, None] & (cols_c >= 0)[None, :]
                if Q_K_IN:  # k runs over W's input dim (the forward GEMMs)
                    b = dq_tile(q_e, s_e, lut_ptr, cols_c[None, :], kk[:, None], qmask, q_row, q_scale_at, Q_GROUP)
                else:  # k runs over W's output dim (the backward's dh and dx GEMMs)
                    b = dq_tile(q_e, s_e, lut_ptr, kk[:, None], cols_c[None, :], qmask, q_row, q_scale_at, Q_GROUP)
            elif Q_K_IN:  # W's rows cols_c (wrapped: all real), inputs k * BLOCK_K..: [BN, BK], transposed
                b = tl.trans(dq_rows(q_e, s_e, lut_ptr, cols_c, cols_c >= 0, k * BLOCK_K, K_red, q_row, q_scale_at,
                                     BLOCK_K, Q_GROUP, Q_DQ, not EVEN_K, a_ptr.dtype.element_ty))  # fmt: skip
            else:  # W's rows kk (its outputs), inputs from this tile's first column (past N: zeros, not wrapped)
                b = dq_rows(q_e, s_e, lut_ptr, kk, kk < K_red, pid_n * BLOCK_N, N, q_row, q_scale_at, BLOCK_N,
                            Q_GROUP, Q_DQ, not EVEN_N, a_ptr.dtype.element_ty)  # fmt: skip
            b = b.to(a_ptr.dtype.element_ty)
        elif EVEN_K:
            b = tl.load(b_ptrs)
        else:
            b = tl.load(b_ptrs, mask=kmask[:, None], other=0.0)
        acc = tl.dot(a, b, acc, input_precision=PREC)
        if LORA and L_MODE == 0:
            if EVEN_K:
                pk = tl.load(p_ptrs)
            else:
                pk = tl.load(p_ptrs, mask=kmask[:, None], other=0.0)
            acc_l = tl.dot(a, pk, acc_l, input_precision=PREC)
            p_ptrs += BLOCK_K * stride_pk
        if EPI == 1 and QUANT:  # (the forward: Q_K_IN)
            if Q_DQ == 0:
                bu = dq_tile(q_e, s_e, lut_ptr, up_cols + cols_c[None, :], kk[:, None], qmask, q_row, q_scale_at,
                             Q_GROUP)  # fmt: skip
            else:
                bu = tl.trans(dq_rows(q_e, s_e, lut_ptr, up_cols + cols_c, cols_c >= 0, k * BLOCK_K, K_red, q_row,
                                      q_scale_at, BLOCK_K, Q_GROUP, Q_DQ, not EVEN_K, a_ptr.dtype.element_ty))  # fmt: skip
            acc_u = tl.dot(a, bu.to(a_ptr.dtype.element_ty), acc_u, input_precision=PREC)
        elif EPI == 1:
            if EVEN_K:
                bu = tl.load(b_ptrs + up_cols * stride_bn)
            else:
                bu = tl.load(b_ptrs + up_cols * stride_bn, mask=kmask[:, None], other=0.0)
            acc_u = tl.dot(a, bu, acc_u, input_precision=PREC)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K * stride_bk

    if LORA:  # + L @ R_e, L rounded to the inputs' dtype (as it is stored)
        if L_MODE == 0:
            l_tile = acc_l.to(a_ptr.dtype.element_ty)
            r_ptrs = _r_ptrs(r_ptr, e, kr, cols_c, stride_re, stride_rk, stride_rn)
            r_tile = tl.load(r_ptrs, mask=(kr < rank)[:, None], other=0.0)
            if EPI == 1:
                r_u_tile = tl.load(r_ptrs + up_cols * stride_rn, mask=(kr < rank)[:, None], other=0.0)
        else:
            l_tile, r_tile = l_early.to(a_ptr.dtype.element_ty), r_early
            if EPI == 1:
                r_u_tile = r_u_early
        if pid_n == 0 and L_MODE != 2:  # stored (row order) for the weight gradients; L_MODE 2 read it from there
            tl.store(l_ptr + rows.to(tl.int64)[:, None] * stride_lm + kr[None, :], l_tile, mask=lmask)
        acc = tl.dot(l_tile, r_tile, acc, input_precision=PREC)
        if EPI == 1:
            acc_u = tl.dot(l_tile, r_u_tile, acc_u, input_precision=PREC)

    mask = rmask[:, None] & cmask[None, :]
    if SCATTER_C or EPI != 0:
        slots = tl.load(slot_ptr + rows_c).to(tl.int64)
    # Tiles in row order: a 64-bit base per tile and 32-bit offsets within it (a [BM, BN] tensor of 64-bit
    # pointers costs two registers per element, and the epilogues run at the register limit).
    local = tl.arange(0, BLOCK_M)[:, None]
    if SCATTER_C:
        c_ptrs = c_ptr + slots[:, None] * stride_cm + cols[None, :]
    else:
        c_ptrs = (c_ptr + row0.to(tl.int64) * stride_cm) + (local * stride_cm + cols[None, :])
    if EPI == 0:
        tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=mask)
    else:
        w = tl.load(w_ptr + slots).to(tl.float32)[:, None]
        h_ptrs = (h_ptr + row0.to(tl.int64) * stride_hm) + (local * stride_hm + cols[None, :])
        if EPI == 1:
            g = acc
            u = acc_u
            if SAVE_H:
                tl.store(h_ptrs, g.to(h_ptr.dtype.element_ty), mask=mask)
                tl.store(h_ptrs + up_cols, u.to(h_ptr.dtype.element_ty), mask=mask)
            act = g * tl.sigmoid(g) * u * w
            tl.store(c_ptrs, act.to(c_ptr.dtype.element_ty), mask=mask)
        else:
            # acc = d(act * w) for columns j; h holds the pre-activations g (col j) and u (col I + j)
            g = tl.load(h_ptrs, mask=mask, other=0.0).to(tl.float32)
            u = tl.load(h_ptrs + up_cols, mask=mask, other=0.0).to(tl.float32)
            sig = tl.sigmoid(g)
            silu = g * sig
            d_act = acc * w
            dg = d_act * u * sig * (1.0 + g * (1.0 - sig))
            du = d_act * silu
            tl.store(c_ptrs, dg.to(c_ptr.dtype.element_ty), mask=mask)
            tl.store(c_ptrs + up_cols, du.to(c_ptr.dtype.element_ty), mask=mask)
            dw = tl.sum(tl.where(mask, acc * silu * u, 0.0), axis=1)
            tl.store(dw_ptr + rows.to(tl.int64) * tl.cdiv(N, BLOCK_N) + pid_n, dw, mask=rmask)


@triton.jit
def _grouped_wgrad_kernel(
    a_ptr, a_idx_ptr, b_ptr, b_idx_ptr, c_ptr, offs_ptr,
    N1, N2, stride_am, stride_bm, stride_ce, stride_c1, stride_cs, w_ptr, slot_ptr, up_cols,
    GATHER_A: tl.constexpr, GATHER_B: tl.constexpr, EVEN_N1: tl.constexpr, EVEN_N2: tl.constexpr,
    B_SWIGLU: tl.constexpr, PREC: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):  # fmt: skip
    """c[e, i, j] = sum_r A[a_row(r), i] * B[b_row(r), j] over the rows r of expert e (program axis 1). With more
    than one program on axis 2, program s sums the s-th of as many equal chunks of the rows into c + s * stride_cs
    (partial sums, added up by the caller). B_SWIGLU: B is the weighted SwiGLU output recomputed from the saved
    pre-activations (b_ptr: h [M, 2 * up_cols], rows in row order): silu(h[r, j]) * h[r, up_cols + j] * w[slot[r]],
    so the forward need not keep it."""
    pid_m, pid_n = _tile_of(tl.program_id(0), tl.cdiv(N1, BLOCK_M), tl.cdiv(N2, BLOCK_N), GROUP_M)
    e = tl.program_id(1)
    start = tl.load(offs_ptr + e)
    end = tl.load(offs_ptr + e + 1)
    n_split = tl.num_programs(2)
    if n_split > 1:
        chunk = tl.cdiv(tl.cdiv(end - start, n_split), BLOCK_K) * BLOCK_K
        start = tl.minimum(start + tl.program_id(2) * chunk, end)
        end = tl.minimum(start + chunk, end)
        c_ptr += tl.program_id(2).to(tl.int64) * stride_cs
    i = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    j = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    i_c = i % N1
    j_c = j % N2
    if EVEN_N1:  # (contiguity hints only where no tile wraps)
        i_c = tl.max_contiguous(tl.multiple_of(i_c, BLOCK_M), BLOCK_M)
    if EVEN_N2:
        j_c = tl.max_contiguous(tl.multiple_of(j_c, BLOCK_N), BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for r0 in range(start, end, BLOCK_K):
        rows = r0 + ks
        rmask = rows < end
        rows_c = tl.minimum(rows, end - 1)
        if GATHER_A:
            a_rows = tl.load(a_idx_ptr + rows_c).to(tl.int64)
        else:
            a_rows = rows_c.to(tl.int64)
        if GATHER_B:
            b_rows = tl.load(b_idx_ptr + rows_c).to(tl.int64)
        else:
            b_rows = rows_c.to(tl.int64)
        a = tl.load(a_ptr + a_rows[:, None] * stride_am + i_c[None, :], mask=rmask[:, None], other=0.0)  # [BK, BM]
        if B_SWIGLU:
            h_ptrs = b_ptr + b_rows[:, None] * stride_bm + j_c[None, :]
            hg = tl.load(h_ptrs, mask=rmask[:, None], other=0.0).to(tl.float32)
            hu = tl.load(h_ptrs + up_cols, mask=rmask[:, None], other=0.0).to(tl.float32)
            wr = tl.load(w_ptr + tl.load(slot_ptr + rows_c)).to(tl.float32)
            b = (hg * tl.sigmoid(hg) * hu * wr[:, None]).to(b_ptr.dtype.element_ty)
        else:
            b = tl.load(b_ptr + b_rows[:, None] * stride_bm + j_c[None, :], mask=rmask[:, None], other=0.0)  # [BK, BN]
        acc = tl.dot(tl.trans(a), b, acc, input_precision=PREC)
    c_ptrs = c_ptr + e.to(tl.int64) * stride_ce + i.to(tl.int64)[:, None] * stride_c1 + j[None, :]
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=(i < N1)[:, None] & (j < N2)[None, :])
