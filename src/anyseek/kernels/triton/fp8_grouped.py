"""The routed experts' FP8 GEMMs, DeepSeek-V3's recipe with the bf16 path's fused gather / scatter (twins in
`kernels.reference.fp8`: `grouped_gemm`, and the experts' whole step, `experts_forward` / `experts_backward`, which
`kernels/ops/fp8.py` runs on these kernels).

    C[r] = a[row(r)] @ b[e]^T    for the rows r of expert e (rows sorted by expert: `moe_plan.build_plan`)

a [R, K] E4M3 with 1x128 scales sa [R, KB]: the tokens (quantized once, before any gather) or rows in plan order;
row(r) = tok[r] with gather (the first GEMM reads each token's FP8 row and scales where the expert needs them: no
permuted copy), else r. b [E, N, K] E4M3, each expert's weight in nn.Linear's layout (K-contiguous), with 128x128
block scales sb [E, NB, KB]. C [M, N] in plan order, or with scatter at row slot[r] (token order: t*K + k). The
K-loop promotes every 128 products into fp32 as the dense kernel does (`fp8_gemm.py`). Row tiles come from the
plan's tile map (never straddling two experts, grid independent of the counts: no host sync, CUDA-graph safe).

    grouped_wgrad   dW[e] = A_e^T B_e over expert e's rows, from `plan_rows_t`'s operands: x^T of the rows in plan
                    order, quantized in 128x1 tiles that follow the plan's row tiles (so no tile crosses two
                    experts), gathered through tok or dequantized from an FP8 copy as it is read.

Shape legend: R rows of a, M routed rows, E experts, N output columns, K the reduction dim, BM x BN a tile.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from anyseek.kernels.triton.fp8_gemm import block_dot, scaled_dot
from anyseek.kernels.triton.fp8_quant import _quantize_cols, _quantize_rows
from anyseek.kernels.triton.launch import launch
from anyseek.kernels.triton.moe_gemm import _tile_of
from anyseek.kernels.triton.swiglu import _tile as _swiglu_tile

TILE = 128
CONFIG = {"BN": 128, "GROUP_M": 8, "num_warps": 8, "num_stages": 4}  # BM: the plan's block_m (128 on a GPU)
INTERPRET_CONFIG = {"BN": 32, "GROUP_M": 2, "num_warps": 4, "num_stages": 1}


@triton.jit
def _grouped_kernel(A, SA, TOK, SLOT, B, SB, C, OFFS, TILE_E, TILE_ROW, n_tiles_m, N, K,
                    stride_a, stride_sa, stride_be, stride_bn, stride_sbe, stride_sbn, stride_c,
                    GATHER: tl.constexpr, SCATTER: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                    BK: tl.constexpr, GROUP_M: tl.constexpr, SCALED: tl.constexpr):  # fmt: skip
    pid_m, pid_n = _tile_of(tl.program_id(0), n_tiles_m, tl.cdiv(N, BN), GROUP_M)  # neighbours share B tiles
    e = tl.load(TILE_E + pid_m)
    if e < 0:
        return
    row0 = tl.load(TILE_ROW + pid_m)
    row_end = tl.load(OFFS + e + 1)
    rows = row0 + tl.arange(0, BM)
    rmask = rows < row_end
    rows_c = tl.minimum(rows, row_end - 1)  # clamped: loads need no row mask (a tile holds >= 1 valid row)
    if GATHER:
        a_rows = tl.load(TOK + rows_c).to(tl.int64)
    else:
        a_rows = rows_c.to(tl.int64)
    rn = pid_n * BN + tl.arange(0, BN)
    rn_c = rn % N  # wrapped: loads need no column mask
    rk = tl.arange(0, BK)
    a_ptr = A + a_rows[:, None] * stride_a + rk[None, :]
    b_ptr = B + e.to(tl.int64) * stride_be + rn_c[:, None].to(tl.int64) * stride_bn + rk[None, :]
    sa_ptr = SA + a_rows * stride_sa
    sb_ptr = SB + e.to(tl.int64) * stride_sbe + (rn_c // BK) * stride_sbn
    sb_tile = SB + e.to(tl.int64) * stride_sbe + pid_n * stride_sbn  # (BN == BK: the tile's one block of b)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for kb in range(tl.cdiv(K, BK)):
        k_ok = rk < K - kb * BK
        a = tl.load(a_ptr, mask=k_ok[None, :], other=0.0)
        b = tl.load(b_ptr, mask=k_ok[None, :], other=0.0)
        block = block_dot(a, b, SCALED)  # this K-block's products, summed by the tensor cores
        sa = tl.load(sa_ptr + kb)
        if BN == BK:  # one scale of b a tile: the promotion is one fused multiply-add an element (fp8_gemm.CONFIG)
            acc = tl.fma(block, (sa * tl.load(sb_tile + kb))[:, None], acc)
        else:
            acc += block * sa[:, None] * tl.load(sb_ptr + kb)[None, :]  # promoted in fp32
        a_ptr += BK
        b_ptr += BK
    if SCATTER:
        c_rows = tl.load(SLOT + rows_c).to(tl.int64)
    else:
        c_rows = rows.to(tl.int64)
    tl.store(C + c_rows[:, None] * stride_c + rn[None, :], acc.to(C.dtype.element_ty),
             mask=rmask[:, None] & (rn < N)[None, :])  # fmt: skip


def grouped_gemm(a_RK: torch.Tensor, sa_RB: torch.Tensor, b_ENK: torch.Tensor, sb_E: torch.Tensor, plan,
                 block_m: int, out_dtype: torch.dtype = torch.bfloat16, gather: bool = False, scatter: bool = False,
                 config: dict | None = None) -> torch.Tensor:  # fmt: skip
    """C [M, N] (plan order; with scatter, slot order) in out_dtype = a[row(r)] @ b[e]^T per routed row, from E4M3
    a [R, K] (scales [R, KB]) and b [E, N, K] (128x128 block scales [E, NB, KB]); plan = `moe_plan.build_plan`'s
    (slot, tok, offs, tile_expert, tile_row) built with `block_m` (the row tile here). gather: a holds the tokens
    (row(r) = tok[r]); else a holds the M routed rows in plan order. Rows of slots no expert takes are not written
    (their values are unspecified, as `kernels.routed_experts` says of those slots)."""
    slot, tok, offs, tile_expert, tile_row = plan
    M, (E, N, K) = slot.numel(), b_ENK.shape
    KB = triton.cdiv(K, TILE)
    if a_RK.shape[1] != K or a_RK.stride(1) != 1 or b_ENK.stride(2) != 1:
        raise ValueError(f"fp8 grouped_gemm: a [R, K] and b [E, N, K], K-contiguous, expected; got a "
                         f"{tuple(a_RK.shape)}, b {tuple(b_ENK.shape)}")
    if sa_RB.shape != (a_RK.shape[0], KB) or sb_E.shape != (E, triton.cdiv(N, TILE), KB):
        raise ValueError(f"fp8 grouped_gemm: scales sa {tuple(sa_RB.shape)}, sb {tuple(sb_E.shape)} do not fit a "
                         f"{tuple(a_RK.shape)} (1x128 tiles) and b {tuple(b_ENK.shape)} (128x128 blocks)")
    if not gather and a_RK.shape[0] != M:
        raise ValueError(f"fp8 grouped_gemm: without gather a must hold the plan's {M} rows, got {a_RK.shape[0]}")
    if a_RK.device.type == "cpu" and out_dtype != torch.float32:  # (the interpreter rounds to bf16 toward zero)
        return grouped_gemm(a_RK, sa_RB, b_ENK, sb_E, plan, block_m, torch.float32, gather, scatter,
                            config).to(out_dtype)  # fmt: skip
    c = torch.empty(M, N, dtype=out_dtype, device=a_RK.device)
    if M == 0 or N == 0:
        return c
    sa_RB, sb_E = sa_RB.contiguous(), sb_E.contiguous()
    cfg = dict(config or (INTERPRET_CONFIG if a_RK.device.type == "cpu" else CONFIG))
    BN, group_m = cfg.pop("BN"), cfg.pop("GROUP_M")
    n_m = tile_expert.numel()
    launch(_grouped_kernel, (n_m * triton.cdiv(N, BN),), cfg)(
        a_RK, sa_RB, tok, slot, b_ENK, sb_E, c, offs, tile_expert, tile_row, n_m, N, K, a_RK.stride(0),
        sa_RB.stride(0), b_ENK.stride(0), b_ENK.stride(1), sb_E.stride(0), sb_E.stride(1), c.stride(0),
        GATHER=gather, SCATTER=scatter, BM=block_m, BN=BN, BK=TILE, GROUP_M=group_m,
        SCALED=scaled_dot(a_RK.device))  # fmt: skip
    return c



# ------------------------------------------------------------------------------------- the experts' weight gradients


@triton.jit
def _plan_rows_t_kernel(X, SX, TOK, QT, ST, OFFS, TILE_E, TILE_ROW, C, stride_x, stride_sx, stride_qt, stride_st,
                        GATHER: tl.constexpr, DEQUANT: tl.constexpr, BC: tl.constexpr, TILE: tl.constexpr):  # fmt: skip
    """Plan row tile u (<= 128 rows of one expert) x BC columns of x -> x^T's E4M3 values at [columns, rows] and one
    scale per column and tile, ST[u, column] (a tile's scales side by side: Wgrad reads them in one coalesced load):
    the 128x1 tiles along each expert's rows that Wgrad reduces over. GATHER: row r reads x[tok[r]]; DEQUANT: x is
    E4M3 with 1x128 scales SX (BC divides 128)."""
    u = tl.program_id(0)
    e = tl.load(TILE_E + u)
    if e < 0:
        return
    rows = tl.load(TILE_ROW + u) + tl.arange(0, TILE)
    end = tl.load(OFFS + e + 1)
    rmask = rows < end
    rows_c = tl.minimum(rows, end - 1)
    if GATHER:
        src = tl.load(TOK + rows_c).to(tl.int64)
    else:
        src = rows_c.to(tl.int64)
    cols = tl.program_id(1) * BC + tl.arange(0, BC)
    mask = rmask[:, None] & (cols < C)[None, :]
    x = tl.load(X + src[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    if DEQUANT:
        x = x * tl.load(SX + src * stride_sx + (tl.program_id(1) * BC) // TILE)[:, None]
    q, s = _quantize_cols(x)
    tl.store(QT + cols[None, :].to(tl.int64) * stride_qt + rows[:, None], q.to(QT.dtype.element_ty), mask=mask)
    tl.store(ST + u.to(tl.int64) * stride_st + cols, s, mask=cols < C)


@triton.jit
def _wgrad_kernel(AT, SAT, BT, SBT, C, U_FIRST, OFFS, N1, N2, stride_a, stride_sa, stride_b, stride_sb, stride_ce,
                  stride_c, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
                  SCALED: tl.constexpr):  # fmt: skip
    """C[e] = A_e^T B_e in fp32, A^T [N1, M] and B^T [N2, M] in E4M3 with scales per (plan tile, column), SAT
    [U, N1] and SBT [U, N2]: the reduction runs over expert e's plan tiles, each a 128-wide K-block promoted into
    fp32 with its scales (one contiguous load of each side's: the dense Wgrad went from 301 to 652 TFLOP/s when its
    scales were laid out so, `fp8_gemm.CONFIG`). Expert e's tiles are consecutive, U_FIRST[e] on, and cover its rows
    OFFS[e]:OFFS[e+1] 128 at a time (`moe_plan`), so the loop steps its pointers as the dense GEMM's does (no load
    of a tile's first row in the loop for the next K-block's addresses to wait on)."""
    e = tl.program_id(1)
    pid_m, pid_n = _tile_of(tl.program_id(0), tl.cdiv(N1, BM), tl.cdiv(N2, BN), GROUP_M)
    i = pid_m * BM + tl.arange(0, BM)
    j = pid_n * BN + tl.arange(0, BN)
    i_c, j_c = (i % N1).to(tl.int64), (j % N2).to(tl.int64)
    row0, end = tl.load(OFFS + e), tl.load(OFFS + e + 1)
    u0 = tl.load(U_FIRST + e)
    rk = tl.arange(0, BK)
    a_ptr = AT + i_c[:, None] * stride_a + (row0 + rk)[None, :]
    b_ptr = BT + j_c[:, None] * stride_b + (row0 + rk)[None, :]
    sa_ptr = SAT + u0.to(tl.int64) * stride_sa + i_c
    sb_ptr = SBT + u0.to(tl.int64) * stride_sb + j_c
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for kb in range(tl.cdiv(end - row0, BK)):
        k_ok = (rk < end - row0 - kb * BK)[None, :]
        a = tl.load(a_ptr, mask=k_ok, other=0.0)
        b = tl.load(b_ptr, mask=k_ok, other=0.0)
        block = block_dot(a, b, SCALED)
        acc += block * (tl.load(sa_ptr)[:, None] * tl.load(sb_ptr)[None, :])
        a_ptr += BK
        b_ptr += BK
        sa_ptr += stride_sa
        sb_ptr += stride_sb
    c_ptr = C + e.to(tl.int64) * stride_ce + i.to(tl.int64)[:, None] * stride_c + j[None, :]
    tl.store(c_ptr, acc, mask=(i < N1)[:, None] & (j < N2)[None, :])


def plan_rows_t(x_RC: torch.Tensor, plan, block_m: int, gather: bool = False,
                s_RB: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """x's rows in plan order (gathered through tok when `gather`), transposed and quantized in 128x1 tiles that
    follow the plan's row tiles (each within one expert): -> (q^T [C, M] E4M3, scales [U, C] fp32, plan tile u and
    column c). s_RB: x is E4M3 with these 1x128 scales (dequantized as it is read). block_m must be 128."""
    if block_m != TILE:
        raise ValueError(f"plan_rows_t: the plan's row tiles must be {TILE} rows (the recipe's tile), got {block_m}")
    slot, tok, offs, tile_expert, tile_row = plan
    M, C = slot.numel(), x_RC.shape[1]
    qt = torch.empty(C, M, dtype=torch.float8_e4m3fn, device=x_RC.device)
    st = torch.empty(tile_expert.numel(), C, dtype=torch.float32, device=x_RC.device)
    if M and C:
        sx = s_RB if s_RB is not None else st
        _plan_rows_t_kernel[(tile_expert.numel(), triton.cdiv(C, 32))](
            x_RC, sx, tok, qt, st, offs, tile_expert, tile_row, C, x_RC.stride(0), sx.stride(0), qt.stride(0),
            st.stride(0), GATHER=gather, DEQUANT=s_RB is not None, BC=32, TILE=TILE, num_warps=4)  # fmt: skip
    return qt, st


def tile_starts(plan, n_experts: int, block_m: int) -> torch.Tensor:
    """Each expert's first plan tile (int32 [E + 1], the last: the tiles in all), on the device: the plan gives
    expert e cdiv(rows of e, block_m) consecutive tiles, experts in order."""
    counts = plan[2][1:n_experts + 1] - plan[2][:n_experts]
    tiles = (counts + block_m - 1) // block_m
    return torch.cat([tiles.new_zeros(1), tiles.cumsum(0)]).to(torch.int32)


def grouped_wgrad(at_N1M: torch.Tensor, sat: torch.Tensor, bt_N2M: torch.Tensor, sbt: torch.Tensor, plan,
                  n_experts: int, block_m: int, config: dict | None = None) -> torch.Tensor:  # fmt: skip
    """dW [E, N1, N2] fp32, dW[e] = sum over expert e's rows r of A[r]^T B[r], from `plan_rows_t`'s transposed E4M3
    operands (1x128 tiles along each expert's rows; scales [U, N1] and [U, N2]). An expert without rows gets
    zeros."""
    N1, N2 = at_N1M.shape[0], bt_N2M.shape[0]
    if at_N1M.shape[1] == 0 or N1 == 0 or N2 == 0:
        return torch.zeros(n_experts, N1, N2, dtype=torch.float32, device=at_N1M.device)
    # every expert's every tile is written (an expert without rows: zeros), so no memset first (2.2 GB a backward
    # of 16B's experts at 32k tokens)
    c = torch.empty(n_experts, N1, N2, dtype=torch.float32, device=at_N1M.device)
    cfg = dict(config or (INTERPRET_CONFIG if at_N1M.device.type == "cpu" else CONFIG))
    BN, group_m = cfg.pop("BN"), cfg.pop("GROUP_M")
    BM = 32 if at_N1M.device.type == "cpu" else 128
    grid = (triton.cdiv(N1, BM) * triton.cdiv(N2, BN), n_experts)
    launch(_wgrad_kernel, grid, cfg)(
        at_N1M, sat, bt_N2M, sbt, c, tile_starts(plan, n_experts, block_m), plan[2], N1, N2,
        at_N1M.stride(0), sat.stride(0), bt_N2M.stride(0), sbt.stride(0), c.stride(0), c.stride(1),
        BM=BM, BN=BN, BK=TILE, GROUP_M=group_m, SCALED=scaled_dot(at_N1M.device))  # fmt: skip
    return c


# --------------------------------------------------------------------------------- the weighted SwiGLU between them


@triton.jit
def _swiglu_quant_kernel(H, W, Q, S, M, I, stride_h, stride_q, stride_s, BR: tl.constexpr, TILE: tl.constexpr):
    """act = silu(g) * u * w[r] for a [BR, 128] tile in fp32, quantized per 1x128 tile as it is made: the down
    GEMM's FP8 input without a bf16 copy of act or a pass of its own."""
    rows, cols, mask, g, u = _swiglu_tile(H, M, I, stride_h, BR, TILE)
    w = tl.load(W + rows, mask=rows < M, other=0.0).to(tl.float32)
    q, s = _quantize_rows(g * tl.sigmoid(g) * u * w[:, None], False)
    tl.store(Q + rows[:, None] * stride_q + cols[None, :], q.to(Q.dtype.element_ty), mask=mask)
    tl.store(S + rows * stride_s + tl.program_id(1), s, mask=rows < M)


@triton.jit
def _dswiglu_kernel(H, W, DA, DH, DW, M, I, stride_h, stride_da, stride_dh, n_col, BR: tl.constexpr,
                    BC: tl.constexpr):  # fmt: skip
    """dh = d(silu(g) u w)/d[g, u] for d_act, and this column tile's part of dw[r] = sum_j silu(g) u d_act."""
    rows, cols, mask, g, u = _swiglu_tile(H, M, I, stride_h, BR, BC)
    d = tl.load(DA + rows[:, None] * stride_da + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    w = tl.load(W + rows, mask=rows < M, other=0.0).to(tl.float32)
    sig = tl.sigmoid(g)
    silu = g * sig
    tl.store(DW + rows * n_col + tl.program_id(1), tl.sum(silu * u * d, axis=1), mask=rows < M)
    d = d * w[:, None]
    to = rows[:, None] * stride_dh + cols[None, :]
    tl.store(DH + to, (d * u * sig * (1.0 + g * (1.0 - sig))).to(DH.dtype.element_ty), mask=mask)
    tl.store(DH + to + I, (d * silu).to(DH.dtype.element_ty), mask=mask)


def swiglu_quant(h_MF: torch.Tensor, w_M: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """silu(gate) * up * w per row (h = [gate | up] [M, 2I], w [M]) in fp32, quantized per 1x128 tile: -> (q [M, I]
    E4M3, scales [M, IB]) (twin: `quantize_rows(swiglu_weighted(h, w))`)."""
    M, I = h_MF.shape[0], h_MF.shape[1] // 2
    q = torch.empty(M, I, dtype=torch.float8_e4m3fn, device=h_MF.device)
    s = torch.empty(M, triton.cdiv(I, TILE), dtype=torch.float32, device=h_MF.device)
    if M and I:
        _swiglu_quant_kernel[(triton.cdiv(M, 16), s.shape[1])](h_MF, w_M, q, s, M, I, h_MF.stride(0), q.stride(0),
                                                              s.stride(0), BR=16, TILE=TILE, num_warps=4)  # fmt: skip
    return q, s


def dswiglu(h_MF: torch.Tensor, w_M: torch.Tensor, d_act_MI: torch.Tensor, out_dtype: torch.dtype):
    """The gradients of `swiglu_quant`'s act for d_act [M, I] -> (dh [M, 2I] in out_dtype, dw [M] fp32) (twin:
    `dswiglu_weighted`)."""
    M, I = d_act_MI.shape
    BR, BC = 8, 256
    dh = torch.empty(M, 2 * I, dtype=out_dtype, device=h_MF.device)
    n_col = triton.cdiv(I, BC)
    parts = torch.zeros(M, n_col, dtype=torch.float32, device=h_MF.device)
    if M and I:
        _dswiglu_kernel[(triton.cdiv(M, BR), n_col)](h_MF, w_M, d_act_MI, dh, parts, M, I, h_MF.stride(0),
                                                     d_act_MI.stride(0), dh.stride(0), n_col, BR=BR, BC=BC,
                                                     num_warps=4)  # fmt: skip
    return dh, parts.sum(1)
