"""Triton routed experts: routing plan on the device, grouped GEMMs with fused gather / SwiGLU / scatter, and a
deterministic fp32 combine; forward and backward as torch.library custom ops wrapped in an autograd Function.

    plan      ids [T, K] -> rows sorted by expert (stable): slot [M], tok [M], offs [E+1], tile map [n_ub]
    forward   act_MI = silu(x[tok] Wg_e^T) * (x[tok] Wu_e^T) * w[slot]      (GEMM 1, SwiGLU epilogue; h kept)
              y_slot[slot] = act_MI Wd_e^T                                   (GEMM 2, scattered to token order)
              y_TD = [add_TD +] sum_k y_slot[t, k]  in fp32                  (fixed order: deterministic)
    backward  d_act = dy[tok] Wd_e -> dh = [dg, du], dw partials             (GEMM 3, dSwiGLU epilogue)
              dWd_e = dy[tok]^T act_MI,  dWgu_e = dh^T x[tok]                (grouped weight-gradient GEMMs)
              dx_slot[slot] = dh Wgu_e,  dx_TD = sum_k dx_slot[t, k] in fp32 (GEMM 4)

No host sync anywhere (the counts and offsets stay on the GPU) and no recompiles when the counts change: every
launch grid depends on T, K, E and the widths only (see moe_gemm.py). The routing weight multiplies the [M, I]
activation before the down projection (as the reference does), so the combine is a plain fp32 sum over k.

Shape legend: T tokens, K experts per token, M = T*K routed rows, E experts, D hidden, I expert width, F = 2I.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from anyseek import kernels
from anyseek.kernels.triton import moe_family
from anyseek.kernels.triton.launch import launch as _launch
from anyseek.kernels.triton.moe_gemm import (
    EPI_DSWIGLU,
    EPI_PLAIN,
    EPI_SWIGLU,
    _grouped_gemm_kernel,
    _grouped_wgrad_kernel,
)

# Launch settings per GPU family: (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages). "gemm" serves the plain and
# the dSwiGLU epilogues, "swiglu" the forward GEMM with two accumulators (gate and up), "wgrad" the weight
# gradients. BLOCK_M must be equal in "gemm", "swiglu" and "dswiglu": the routing plan's row tiles serve all.
# - hopper (sm_90) and blackwell_dc (sm_100/103, 228 KB shared memory per SM): swept on an H100 (benchmarks/moe.py
#   --tune, docs/benchmarks.md): wgrad 128x128x64 tiles, 8 warps, 6 stages (32 KB per stage: the gathered rows'
#   latency wants a deep pipeline; each kernel alone at small 32k, 4 -> 6 stages: 652 -> 571 us and 337 -> 303 us,
#   5 and 7 stages slower than 6; 128x256, 256x128, 4 or 16 warps, BLOCK_K 32 with 6-10 stages all slower);
#   gemm 128x256x64 with 16 warps and 4 stages (48 KB per stage):
#   the whole op's forward+backward 4-7% faster than 128x128 with 8 warps (small 32k 3.40 -> 3.20 ms, 16B 16k 12.74
#   -> 12.25, 671B 8k 57.9 -> 54.0; with 8 warps 128x256 spilled and was 60% slower); the SwiGLU GEMM with two
#   128-wide accumulators and 3 stages (48 KB per stage) was 3% faster than 64-wide ones with 4, and 1-3% faster
#   than with 16 warps.
# - ampere_dc (sm_80, A100: 164 KB): the same tiles with BLOCK_K 32, 16 KB per stage, 4 stages (not measured here).
# - consumer (sm_86/89/120: ~100 KB, RTX 30xx/40xx/50xx, RTX PRO): 128x64 tiles, BLOCK_K 32, 3 stages, ~36 KB
#   (not measured here). On any GPU `_launch` lowers num_stages when shared memory runs out.
# "dswiglu" is the backward's first GEMM, whose epilogue holds the accumulator, both saved pre-activations and the
# dSwiGLU temporaries at once: at 128x128 with 8 warps it needed 255 registers and spilled (172 spills on an H100;
# that GEMM took 879 us at `small` 32k tokens). With 16 warps each thread holds half as much. The whole op's
# forward+backward on the H100, graphed, 8 warps -> 16: small 32k 3.85 -> 3.57 ms, 8k 1.10 -> 1.03, 16B 16k 13.58 ->
# 13.00, 671B 8k 59.0 -> 57.8 (128x64 tiles with 8 warps: 3.68, 1.07, 13.29, 60.7). Elsewhere not measured: half the
# gemm's columns.
_TABLE = {
    "hopper": {"gemm": (128, 256, 64, 16, 4), "swiglu": (128, 128, 64, 8, 3), "wgrad": (128, 128, 64, 8, 6),
               "dswiglu": (128, 128, 64, 16, 4)},
    "ampere_dc": {"gemm": (128, 128, 32, 8, 4), "swiglu": (128, 64, 32, 8, 4), "wgrad": (128, 128, 32, 8, 4),
                  "dswiglu": (128, 64, 32, 8, 4)},
    "consumer": {"gemm": (128, 64, 32, 4, 3), "swiglu": (128, 32, 32, 4, 3), "wgrad": (64, 128, 32, 4, 3),
                 "dswiglu": (128, 32, 32, 4, 3)},
    "interpreter": {"gemm": (16, 16, 16, 1, 1), "swiglu": (16, 16, 16, 1, 1), "wgrad": (16, 16, 16, 1, 1),
                    "dswiglu": (16, 16, 16, 1, 1)},
}
GROUP_M = 8  # row tiles side by side in the launch order, so that they share each weight tile in L2


def family(device: torch.device) -> str:
    """The row of _TABLE for a device (see moe_family.FAMILIES)."""
    if device.type != "cuda":
        return "interpreter"
    return moe_family.family(torch.cuda.get_device_capability(device))


def _config(device: torch.device, kind: str) -> dict:
    bm, bn, bk, warps, stages = _TABLE[family(device)][kind]
    return {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": GROUP_M, "num_warps": warps, "num_stages": stages}


def _prec(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"


# ----------------------------------------------------------------------------------------------------------------
# routing plan


# A stable counting sort in three kernels (torch.sort's radix sort, searchsorted and the tile arithmetic were ~12
# kernels and ~50 us per layer at 32k rows): the ids cut into S segments of SEG; (1) each program (e, s) counts
# expert e in segment s; (2) one program turns the [E, S] counts into each (e, s)'s first row (experts in order,
# segments in order within an expert), the expert offsets and the row-tile map; (3) each program (e, s) writes
# the rows of expert e in segment s at its first row on, in index order (a prefix sum over the segment).
_PLAN_SEGMENTS = 64  # S at most: the scan holds the [E, S] counts in one program


@triton.jit
def _plan_count_kernel(IDS, COUNTS, M, S, SEG: tl.constexpr):
    e = tl.program_id(0)
    s = tl.program_id(1)
    at = s * SEG + tl.arange(0, SEG)
    ids = tl.load(IDS + at, mask=at < M, other=-1)
    tl.store(COUNTS + e * S + s, tl.sum((ids == e).to(tl.int32), axis=0))


@triton.jit
def _plan_scan_kernel(COUNTS, BASE, OFFS, TILE_E, TILE_ROW, E, S, U, block_m, BE: tl.constexpr, BS: tl.constexpr,
                      BU: tl.constexpr):
    re = tl.arange(0, BE)
    rs = tl.arange(0, BS)
    inside = (re[:, None] < E) & (rs[None, :] < S)
    c = tl.load(COUNTS + re[:, None] * S + rs[None, :], mask=inside, other=0)
    tot = tl.sum(c, axis=1)  # [BE] rows of each expert
    first = tl.cumsum(tot, axis=0) - tot  # offs[e]
    base = first[:, None] + tl.cumsum(c, axis=1) - c
    tl.store(BASE + re[:, None] * S + rs[None, :], base, mask=inside)
    tl.store(OFFS + re, first, mask=re < E)
    tl.store(OFFS + E, tl.sum(tot, axis=0))
    tiles = (tot + block_m - 1) // block_m
    cum = tl.cumsum(tiles, axis=0)  # inclusive; experts past E have no tiles
    for u0 in range(0, U, BU):
        u = u0 + tl.arange(0, BU)
        e_u = tl.sum(((cum[None, :] <= u[:, None]) & (re[None, :] < E)).to(tl.int32), axis=1)  # its expert (E: none)
        e_c = tl.minimum(e_u, E - 1)
        pick = re[None, :] == e_c[:, None]
        first_u = tl.sum(tl.where(pick, first[None, :], 0), axis=1)
        start_u = tl.sum(tl.where(pick, cum[None, :] - tiles[None, :], 0), axis=1)
        tl.store(TILE_E + u, tl.where(e_u < E, e_c, -1), mask=u < U)
        tl.store(TILE_ROW + u, first_u + (u - start_u) * block_m, mask=u < U)


@triton.jit
def _plan_place_kernel(IDS, BASE, SLOT, TOK, M, S, K, SEG: tl.constexpr):
    e = tl.program_id(0)
    s = tl.program_id(1)
    at = s * SEG + tl.arange(0, SEG)
    ids = tl.load(IDS + at, mask=at < M, other=-1)
    hit = (ids == e).to(tl.int32)
    row = tl.load(BASE + e * S + s) + tl.cumsum(hit, axis=0) - hit
    tl.store(SLOT + row, at, mask=hit > 0)
    tl.store(TOK + row, at // K, mask=hit > 0)


def build_plan(topk_ids_TK: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, ...]:
    """Rows of the T*K slots sorted by expert (stable), on the device, without a host sync.

    Returns int32 tensors: slot_M (t*K + k of each row), tok_M (t), offs_E1 (expert e owns rows offs[e]:offs[e+1]),
    tile_expert_U and tile_row_U: for each of the n_ub = cdiv(M, block_m) + E row tiles, its expert (-1: unused)
    and first row. Tiles never straddle two experts. Ids must lie in [0, E) (the router's top-k)."""
    ids_M = topk_ids_TK.reshape(-1).to(torch.int32)
    M, K, E = ids_M.numel(), max(topk_ids_TK.shape[-1], 1), num_experts
    dev = ids_M.device
    seg = max(256, triton.next_power_of_2(triton.cdiv(max(M, 1), _PLAN_SEGMENTS)))
    S = max(1, triton.cdiv(M, seg))
    U = triton.cdiv(M, block_m) + E
    i32 = dict(dtype=torch.int32, device=dev)
    slot, tok, offs = torch.empty(M, **i32), torch.empty(M, **i32), torch.empty(E + 1, **i32)
    tile_expert, tile_row = torch.empty(U, **i32), torch.empty(U, **i32)
    counts, base = torch.empty(E, S, **i32), torch.empty(E, S, **i32)
    warps = 4 if seg <= 1024 else 8
    _plan_count_kernel[(E, S)](ids_M, counts, M, S, SEG=seg, num_warps=warps)
    BE, BS = triton.next_power_of_2(E), triton.next_power_of_2(S)
    _plan_scan_kernel[(1,)](counts, base, offs, tile_expert, tile_row, E, S, U, block_m, BE=BE, BS=BS,
                            BU=max(16, min(128, 8192 // BE)), num_warps=8)
    _plan_place_kernel[(E, S)](ids_M, base, slot, tok, M, S, K, SEG=seg, num_warps=warps)
    return slot, tok, offs, tile_expert, tile_row


def build_plan_torch(topk_ids_TK: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, ...]:
    """`build_plan` in PyTorch ops (a stable sort): its twin in the tests."""
    ids_M = topk_ids_TK.reshape(-1)
    M, K = ids_M.numel(), max(topk_ids_TK.shape[-1], 1)
    dev = ids_M.device
    sorted_M, order_M = torch.sort(ids_M, stable=True)
    offs_E1 = torch.searchsorted(sorted_M, torch.arange(num_experts + 1, device=dev, dtype=sorted_M.dtype))
    tiles_E = (offs_E1[1:] - offs_E1[:-1] + block_m - 1) // block_m
    cum_E = torch.cumsum(tiles_E, 0)
    i_U = torch.arange(triton.cdiv(M, block_m) + num_experts, device=dev)
    e_U = torch.searchsorted(cum_E, i_U, right=True)
    e_c = e_U.clamp(max=num_experts - 1)
    row_U = offs_E1[e_c] + (i_U - cum_E[e_c] + tiles_E[e_c]) * block_m
    tile_expert_U = torch.where(e_U < num_experts, e_c, -1)
    i32 = torch.int32
    return order_M.to(i32), (order_M // K).to(i32), offs_E1.to(i32), tile_expert_U.to(i32), row_U.to(i32)


# ----------------------------------------------------------------------------------------------------------------
# launchers


def _gemm(a, b_e, strides_b, c, plan, N, K_red, cfg, *, gather=False, scatter=False, epi=EPI_PLAIN, h=None,
          w=None, dw=None, save_h=False, up_cols=0, low_rank=None, l_token=None, l_rows=False):  # fmt: skip
    """C[r] = A[row(r)] @ B_e over the plan's row tiles (see `_grouped_gemm_kernel`). low_rank = (L [M, r], P [E, ...],
    P's strides as (expert, k, n), R [E, ...], R's strides): C[r] = A[row(r)] @ (B_e + P_e R_e), and L (row order)
    receives A[row(r)] @ P_e. Or, instead of forming that product in the loop (P then unread): l_token (gathered A
    only), A @ P_e for every token and expert, [T, E*r] (`_per_token`); l_rows, L already holds it (`_narrow`)."""
    slot, tok, offs, tile_expert, tile_row = plan
    n_m = tile_expert.numel()
    h = c if h is None else h
    grid = (n_m * triton.cdiv(N, cfg["BLOCK_N"]),)
    l_, p_, strides_p, r_, strides_r = low_rank if low_rank is not None else (c, c, (0, 0, 0), c, (0, 0, 0))
    rank = l_.shape[1] if low_rank is not None else 0
    l_mode = 2 if l_rows else 0
    if l_token is not None:
        assert gather and low_rank is not None and l_token.stride(1) == 1, "l_token: gathered rows, a rank-r term"
        p_, strides_p, l_mode = l_token, (0, l_token.stride(0), 1), 1
    _launch(_grouped_gemm_kernel, grid, cfg)(
        a, tok, slot, b_e, c, h, c if w is None else w, c if dw is None else dw, offs, tile_expert, tile_row,
        n_m, N, K_red, a.stride(0), *strides_b, c.stride(0), h.stride(0), up_cols,
        l_, p_, r_, l_.stride(0), *strides_p, *strides_r, rank,
        GATHER_A=gather, SCATTER_C=scatter, EPI=epi, SAVE_H=save_h, EVEN_K=K_red % cfg["BLOCK_K"] == 0,
        EVEN_N=N % cfg["BLOCK_N"] == 0, LORA=low_rank is not None, L_MODE=l_mode,
        RANK=_rank_block(rank), PREC=_prec(a.dtype),
    )  # fmt: skip


def _narrow(a, P, strides_p, plan, K_red: int, out_Mr: torch.Tensor) -> torch.Tensor:
    """out [M, r] = A[row] @ P_e (row order, A not gathered): the grouped GEMM with N = r, one narrow pass over A,
    so that the wide GEMM after it reads L in its epilogue (`_gemm(l_rows=True)`) instead of a second dot in its
    loop over K (small, 8k, H200: that dot made the down GEMM 92 -> 120 us and dx 154 -> 200; this pass takes 9 and
    21 us; dx does not use it by default: _DX_L_ROWS)."""
    r = out_Mr.shape[1]
    cfg = {**_config(a.device, "gemm"), "BLOCK_N": _rank_block(r), "num_warps": 4}
    _gemm(a, P, strides_p, out_Mr, plan, r, K_red, cfg)
    return out_Mr


def _per_token(x_TD: torch.Tensor, P_EKR: torch.Tensor) -> torch.Tensor:
    """x @ P_e for every token and every expert at once: [T, E*r], column e*r + j = sum_k x[t, k] P_e[k, j]. One
    dense matmul reads x once; the routed rows' own products (K of the E per token) are then read from it by the
    grouped GEMM's epilogue (`_gemm(l_token=)`) instead of a narrow second dot in its loop over K (which made the
    LoRA experts' GEMMs ~35% slower on an H200). E/K times the needed FLOPs, 2 T D E r: 8.6 GFLOP at `small`, 8k."""
    E, K_red, r = P_EKR.shape
    return x_TD @ P_EKR.permute(1, 0, 2).reshape(K_red, E * r)


def _rank_block(r: int) -> int:
    """The K (or N) extent of a tile over a rank-r dimension: a power of two, at least 16 (tl.dot's minimum)."""
    return max(16, triton.next_power_of_2(r))


def _wgrad(a, a_idx, b, b_idx, out_EN1N2, offs, cfg, split: int = 1, swiglu=None, partials=None):
    """out[e] = A[rows of e]^T @ B[rows of e], rows gathered through a_idx / b_idx where given. swiglu = (w [M] slot
    order, slot [M]): b is h [M, 2N2] and B the weighted SwiGLU output recomputed from it (`_grouped_wgrad_kernel`'s
    B_SWIGLU). partials (a flat fp32 tensor of split * E * N1 * N2): the sums go there instead, each expert's rows
    in `split` chunks summed separately, for the caller to add up in chunk order (`_sum_splits`: deterministic);
    for narrow outputs (LoRA's rank-r gradients), whose few tiles per expert would leave the GPU idle while the
    busiest expert's rows run through one program."""
    E, N1, N2 = out_EN1N2.shape
    assert split == 1 or partials is not None, "_wgrad: row chunks need a partials buffer"
    target = out_EN1N2 if partials is None else partials.view(split, E, N1, N2)
    grid = (triton.cdiv(N1, cfg["BLOCK_M"]) * triton.cdiv(N2, cfg["BLOCK_N"]), E, split)
    _launch(_grouped_wgrad_kernel, grid, cfg)(
        a, offs if a_idx is None else a_idx, b, offs if b_idx is None else b_idx, target, offs,
        N1, N2, a.stride(0), b.stride(0), target.stride(-3), target.stride(-2), target.stride(0),
        *(swiglu if swiglu is not None else (b, offs)), N2,
        GATHER_A=a_idx is not None, GATHER_B=b_idx is not None, EVEN_N1=N1 % cfg["BLOCK_M"] == 0,
        EVEN_N2=N2 % cfg["BLOCK_N"] == 0, B_SWIGLU=swiglu is not None, PREC=_prec(a.dtype),
    )  # fmt: skip


@triton.jit
def _sum_splits_kernel(P, OUT, n0, n1, n2, n3, s0, s1, s2, s3, SMAX: tl.constexpr, BLOCK: tl.constexpr):
    """OUT (four gradients back to back) = their partial sums added up in chunk order: gradient i's partials lie
    [s_i, n_i] in P after those of the gradients before it."""
    j = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    c1, c2, c3 = n0, n0 + n1, n0 + n1 + n2
    mask = j < c3 + n3
    p1 = s0.to(tl.int64) * n0
    p2 = p1 + s1.to(tl.int64) * n1
    p3 = p2 + s2.to(tl.int64) * n2
    seg1, seg2, seg3 = j >= c1, j >= c2, j >= c3
    start = tl.where(seg3, c3, tl.where(seg2, c2, tl.where(seg1, c1, 0)))
    n = tl.where(seg3, n3, tl.where(seg2, n2, tl.where(seg1, n1, n0)))
    s = tl.where(seg3, s3, tl.where(seg2, s2, tl.where(seg1, s1, s0)))
    at = tl.where(seg3, p3, tl.where(seg2, p2, tl.where(seg1, p1, 0))) + (j - start)
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for k in range(SMAX):  # in chunk order: deterministic
        acc += tl.load(P + at + k * n.to(tl.int64), mask=mask & (k < s), other=0.0)
    tl.store(OUT + j, acc.to(OUT.dtype.element_ty), mask=mask)


def _sum_splits(partials: torch.Tensor, out: torch.Tensor, sizes: list[int], splits: list[int]) -> None:
    """out (flat, the four gradients back to back) = the sums of their partials (`_wgrad(partials=)`), one launch
    instead of a sum and a cast per gradient (on an H100 these 56 launches took ~0.19 ms of the LoRA step)."""
    BLOCK = 1024
    _sum_splits_kernel[(triton.cdiv(out.numel(), BLOCK),)](partials, out, *sizes, *splits, SMAX=max(splits),
                                                          BLOCK=BLOCK, num_warps=4)  # fmt: skip


@triton.jit
def _sum_k_kernel(X, Y, ADD, T, D, K: tl.constexpr, HAS_ADD: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr):
    t = tl.program_id(0).to(tl.int64) * BT + tl.arange(0, BT)
    d = tl.program_id(1) * BD + tl.arange(0, BD)
    mask = (t[:, None] < T) & (d[None, :] < D)
    acc = tl.zeros((BT, BD), dtype=tl.float32)
    if HAS_ADD:  # a [T, D] addend (the shared experts' output) joins the sum, first
        acc += tl.load(ADD + t[:, None] * D + d[None, :], mask=mask, other=0.0).to(tl.float32)
    for k in range(K):  # in slot order: deterministic
        acc += tl.load(X + (t[:, None] * K + k) * D + d[None, :], mask=mask, other=0.0).to(tl.float32)
    tl.store(Y + t[:, None] * D + d[None, :], acc.to(Y.dtype.element_ty), mask=mask)


def _sum_k(rows_MD: torch.Tensor, T: int, dtype: torch.dtype, add_TD: torch.Tensor | None = None) -> torch.Tensor:
    """[T*K, D] in slot order -> [T, D]: the K rows of each token summed in fp32, in a fixed order, rounded to
    `dtype` once (one kernel: torch's fp32 sum then cast read and wrote the [T, D] result twice more). add_TD
    (contiguous [T, D] or None): added into the same fp32 sum (the shared experts' output: no separate add)."""
    M, D = rows_MD.shape
    out = rows_MD.new_empty(T, D, dtype=dtype)
    if T == 0 or M == 0:
        return out.zero_() if add_TD is None else out.copy_(add_TD)
    BT, BD = 16, min(256, triton.next_power_of_2(D))
    _sum_k_kernel[(triton.cdiv(T, BT), triton.cdiv(D, BD))](
        rows_MD.contiguous(), out, out if add_TD is None else add_TD, T, D, K=M // T, HAS_ADD=add_TD is not None,
        BT=BT, BD=BD, num_warps=4,
    )  # fmt: skip
    return out


def _kn(t):
    """Strides (expert, k, n) reading t [E, k, n] as it lies."""
    return t.stride(0), t.stride(1), t.stride(2)


def _nk(t):
    """Strides (expert, k, n) reading t [E, n, k] transposed."""
    return t.stride(0), t.stride(2), t.stride(1)


def experts_fwd(x_TD, w_M, gate_up_EFD, down_EDI, plan, save: bool, low_gu=None, low_dn=None, add_TD=None,
                l_token_gu=None, l_rows_dn=False):  # fmt: skip
    """-> y [T, D] (+ add_TD, a contiguous [T, D] addend, when given), h [M, F] (pre-activations, empty unless
    save), act [M, I] (weighted SwiGLU output). low_gu / low_dn: the two GEMMs' rank-r terms (see `_gemm`; LoRA,
    `experts_fwd_lora`); l_token_gu: the first one's products per token (`_gemm`'s l_token); l_rows_dn: the second
    one's made by a narrow pass first (`_narrow`)."""
    T, D = x_TD.shape
    F = gate_up_EFD.shape[1]
    I = F // 2
    M = plan[0].numel()
    act_MI = x_TD.new_empty(M, I)
    h_MF = x_TD.new_empty(M if save else 0, F)
    if M == 0:
        return (x_TD.new_zeros(T, D) if add_TD is None else add_TD.clone()), h_MF, act_MI
    _gemm(x_TD, gate_up_EFD, _nk(gate_up_EFD), act_MI, plan, I, D, _config(x_TD.device, "swiglu"), gather=True,
          epi=EPI_SWIGLU, h=h_MF if save else None, w=w_M, save_h=save, up_cols=I, low_rank=low_gu,
          l_token=l_token_gu)  # fmt: skip
    y_slot_MD = x_TD.new_empty(M, D)
    if l_rows_dn:
        _narrow(act_MI, low_dn[1], low_dn[2], plan, I, low_dn[0])
    _gemm(act_MI, down_EDI, _nk(down_EDI), y_slot_MD, plan, D, I, _config(x_TD.device, "gemm"), scatter=True,
          low_rank=low_dn, l_rows=l_rows_dn)  # fmt: skip
    return _sum_k(y_slot_MD, T, x_TD.dtype, add_TD), h_MF, act_MI


def _dh(dy_TD, w_M, down_EDI, h_MF, plan, low_rank=None, l_token=None):
    """The backward's first pass: dh [M, F] (the gradient at the gate|up pre-activations, through the weighted
    SwiGLU) and dw [M] (the routing weights' gradient, slot order, fp32). low_rank, l_token: see `_gemm` (LoRA)."""
    M, F = plan[0].numel(), h_MF.shape[1]
    I = F // 2
    gemm = _config(dy_TD.device, "dswiglu")
    dh_MF = dy_TD.new_empty(M, F)
    dw_parts = torch.empty(M, triton.cdiv(I, gemm["BLOCK_N"]), device=dy_TD.device, dtype=torch.float32)
    dn = down_EDI
    if M:
        _gemm(dy_TD, dn, _kn(dn), dh_MF, plan, I, dy_TD.shape[1], gemm,
              gather=True, epi=EPI_DSWIGLU, h=h_MF, w=w_M, dw=dw_parts, up_cols=I, low_rank=low_rank,
              l_token=l_token)  # fmt: skip
    dw_M = torch.empty(M, device=dy_TD.device, dtype=torch.float32)
    dw_M[plan[0].long()] = dw_parts.sum(1)
    return dh_MF, dw_M


def _dx(dh_MF, x_TD, gate_up_EFD, plan, low_rank=None, l_rows=False, cfg=None):
    """dx [T, D] = the K slots' dh @ gate_up of their experts, summed per token. low_rank, l_rows: see `_gemm`
    (LoRA; l_rows: the rank-r product made by a narrow pass first). cfg: launch settings other than "gemm"'s."""
    T, D = x_TD.shape
    M, F = dh_MF.shape
    if not M:
        return torch.zeros_like(x_TD)
    gu = gate_up_EFD
    dx_slot_MD = x_TD.new_empty(M, D)
    if l_rows:
        _narrow(dh_MF, low_rank[1], low_rank[2], plan, F, low_rank[0])
    _gemm(dh_MF, gu, _kn(gu), dx_slot_MD, plan, D, F, cfg or _config(x_TD.device, "gemm"), scatter=True,
          low_rank=low_rank, l_rows=l_rows)  # fmt: skip
    return _sum_k(dx_slot_MD, T, x_TD.dtype)


def experts_bwd(dy_TD, x_TD, w_M, gate_up_EFD, down_EDI, h_MF, act_MI, plan, dgu=None, ddn=None):
    """-> dx [T, D], dw [M] (slot order, fp32), d gate_up [E, F, D], d down [E, D, I] (written into dgu / ddn when
    given: every expert's rows, zeros for an expert without tokens)."""
    tok, offs = plan[1], plan[2]
    dgu = torch.empty_like(gate_up_EFD) if dgu is None else dgu
    ddn = torch.empty_like(down_EDI) if ddn is None else ddn
    wgrad = _config(x_TD.device, "wgrad")
    dh_MF, dw_M = _dh(dy_TD, w_M, down_EDI, h_MF, plan)
    _wgrad(dy_TD, tok, act_MI, None, ddn, offs, wgrad)
    _wgrad(dh_MF, None, x_TD, tok, dgu, offs, wgrad)
    return _dx(dh_MF, x_TD, gate_up_EFD, plan), dw_M, dgu, ddn


# ---------------------------------------------------------------- LoRA: frozen base, per-expert adapters
#
# Effective weights W_e + B_e A_e (the scale folded into B): each big GEMM takes the base weight and adds L @ R_e in
# its epilogue (`_gemm(low_rank=)`), L = A[row] @ P_e being the rows' rank-r product: read from one dense per-token
# matmul where A is gathered from token rows (u_gu, g_dn: `_per_token`), made by a narrow pass first for the down
# GEMM (u_dn: `_narrow`), accumulated beside the GEMM's own product in its loop over K for dx (g_gu; see _L_GIVEN).
# L is kept for the adapters' gradients. Nothing [E, F, D]-sized is formed or kept.
#   forward   u_gu = x[tok] A_gu^T;  h = x[tok] W_gu^T + u_gu B_gu^T  -> SwiGLU -> act
#             u_dn = act A_dn^T;     y_slot = act W_dn^T + u_dn B_dn^T
#   backward  g_dn = dy[tok] B_dn;   d(act) = dy[tok] W_dn + g_dn A_dn -> dSwiGLU -> dh
#             g_gu = dh B_gu;        dx_slot = dh W_gu + g_gu A_gu
#             dB_gu = dh^T u_gu, dA_gu = g_gu^T x[tok], dB_dn = dy[tok]^T u_dn, dA_dn = g_dn^T act (per expert;
#             act recomputed from h inside that product)


def _rank_config(device: torch.device, kind: str, r: int) -> tuple[dict, int]:
    """Tiles and row chunks per expert (`_wgrad`'s split) for the rank-r weight gradients: "wgrad_n" (out
    [E, N1, r]), "wgrad_m" (out [E, r, N2]), "wgrad_m_swiglu" (the same, B recomputed from h)."""
    rb = _rank_block(r)
    base = _config(device, "wgrad")
    if family(device) == "hopper":  # (_RANK_TABLE)
        bk, warps, stages, split = _RANK_TABLE[kind]
        cfg = {**base, "BLOCK_K": bk, "num_warps": warps, "num_stages": stages}  # (base: 128 x 128 tiles)
    else:  # (not measured: the "wgrad" tiles with at most 4 warps and 4 stages, rows in 4 chunks)
        cfg, split = {**base, "num_warps": min(base["num_warps"], 4), "num_stages": min(base["num_stages"], 4)}, 4
    return ({**cfg, "BLOCK_M": rb} if kind != "wgrad_n" else {**cfg, "BLOCK_N": rb}), split


# The rank-r weight gradients on Hopper: (BLOCK_K, warps, stages, row chunks per expert), the other tile side 128.
# Swept alone at `small`, 8k tokens (20 settings x 1/2/4/8 chunks, CUDA-graph replays, H200), us for balanced /
# skewed routing: one chunk is fastest when the experts' rows are even (no partial sums to add up) but leaves the
# busiest expert's rows to one program when they are not (g^T act: 45 / 208 with one chunk), so the chunks stay.
# g^T act (recomputed from h: more work per row) 40.2 / 80.1 with (64, 4, 4, 4) -> 33.8 / 56.9 with (32, 8, 4, 8);
# for the other three (64, 4, 4, 4) was within ~1 us of the best setting at 4 chunks (dh^T u 28.9 / 31.5).
_RANK_TABLE = {"wgrad_n": (64, 4, 4, 4), "wgrad_m": (64, 4, 4, 4), "wgrad_m_swiglu": (32, 8, 4, 8)}
# The LoRA experts' rank-r products: made before each wide GEMM (the gathered two by `_per_token`, down's by
# `_narrow`) and read in its epilogue. False: a second dot inside each wide GEMM's loop over K (the earlier way).
# H200, small, 8k: one MoE layer's LoRA experts fwd+bwd (benchmarks/moe.py --lora) 0.889 -> 0.881 ms balanced,
# 0.943 -> 0.933 skewed; in the training step the experts' grouped GEMMs with the narrow passes and the dense
# per-token products 4.87 -> 4.57 + 0.22 ms (docs/benchmarks.md, stop 33).
_L_GIVEN = True
# ... except dx's, still formed in its loop: H100, small, 8k, the dx GEMM with its product given 180-189 us plus 28 for
# the narrow pass over dh, against 194-200 in the loop (the down GEMM: 96-98 + 10 against 118-124).
_DX_L_ROWS = False
# dx's product in its loop reads B_gu k-major (a transposed copy [E, r, F], 2.8 us) with 8 warps: the second dot
# then costs 25-33 us less (H200, small, 8k, skewed routing: 188-198 -> 155-173 us; plain dx 130-153 in the same
# runs; 16 warps or B_gu as it lies, [E, F, r], gain nothing). Elsewhere "gemm" as it is (not measured).
_DX_LOOP_WARPS = {"hopper": 8}


def _lora_dx_config(device: torch.device) -> dict:
    cfg = _config(device, "gemm")
    warps = _DX_LOOP_WARPS.get(family(device))
    return {**cfg, "num_warps": warps} if warps and not _DX_L_ROWS else cfg


def experts_fwd_lora(x_TD, w_M, gate_up_EFD, down_EDI, adapters, plan, save: bool, add_TD=None):
    """experts_fwd for frozen base weights plus adapters (A_gu [E, r, D], B_gu [E, F, r], A_dn [E, r, I],
    B_dn [E, D, r], the scale in the B's): -> y [T, D] (+ add_TD, as experts_fwd), h [M, F], act [M, I],
    u_gu [M, r], u_dn [M, r]."""
    A_gu, B_gu, A_dn, B_dn = adapters
    M, r = plan[0].numel(), A_gu.shape[1]
    u_gu, u_dn = x_TD.new_empty(M, r), x_TD.new_empty(M, r)
    y_TD, h_MF, act_MI = experts_fwd(x_TD, w_M, gate_up_EFD, down_EDI, plan, save,
                                     low_gu=(u_gu, A_gu, _nk(A_gu), B_gu, _nk(B_gu)),
                                     low_dn=(u_dn, A_dn, _nk(A_dn), B_dn, _nk(B_dn)), add_TD=add_TD,
                                     l_token_gu=_per_token(x_TD, A_gu.transpose(1, 2)) if _L_GIVEN and M else None,
                                     l_rows_dn=_L_GIVEN)  # fmt: skip
    return y_TD, h_MF, act_MI, u_gu, u_dn


def experts_bwd_lora(dy_TD, x_TD, w_M, gate_up_EFD, down_EDI, h_MF, u_gu, u_dn, plan, adapters):
    """Backward of `experts_fwd_lora`: -> dx [T, D], dw [M] (fp32), dA_gu, dB_gu, dA_dn, dB_dn (the adapters'
    shapes; B's gradient being that of the scaled B). The base weights get none. The SwiGLU output the down
    adapter's gradient needs is recomputed from h inside that product (the forward keeps no [M, I] tensor)."""
    A_gu, B_gu, A_dn, B_dn = adapters
    r, M = A_gu.shape[1], plan[0].numel()
    tok, offs = plan[1], plan[2]
    g_dn, g_gu = x_TD.new_empty(M, r), x_TD.new_empty(M, r)
    dh_MF, dw_M = _dh(dy_TD, w_M, down_EDI, h_MF, plan, low_rank=(g_dn, B_dn, _kn(B_dn), A_dn, _kn(A_dn)),
                      l_token=_per_token(dy_TD, B_dn) if _L_GIVEN and M else None)
    B_gu_rf = B_gu.transpose(1, 2).contiguous()  # [E, r, F]: read k-major in dx's loop (_DX_LOOP_WARPS)
    dx = _dx(dh_MF, x_TD, gate_up_EFD, plan, low_rank=(g_gu, B_gu_rf, _nk(B_gu_rf), A_gu, _kn(A_gu)),
             l_rows=_L_GIVEN and _DX_L_ROWS, cfg=_lora_dx_config(x_TD.device))  # fmt: skip
    # the four gradients (the adapters' order) back to back in one buffer; each product leaves its row chunks'
    # partial sums in one fp32 buffer, added up by one launch
    jobs = [(g_gu, None, x_TD, tok, "wgrad_m", None),  # dA_gu = g_gu^T x
            (dh_MF, None, u_gu, None, "wgrad_n", None),  # dB_gu = dh^T u_gu
            (g_dn, None, h_MF, None, "wgrad_m_swiglu", (w_M, plan[0])),  # dA_dn = g_dn^T act
            (dy_TD, tok, u_dn, None, "wgrad_n", None)]  # dB_dn = dy^T u_dn
    cfgs = [_rank_config(x_TD.device, job[4], r) for job in jobs]
    sizes, splits = [t.numel() for t in adapters], [split for _, split in cfgs]
    flat = A_gu.new_empty(sum(sizes))
    grads = [v.view(t.shape) for v, t in zip(flat.split(sizes), adapters)]
    parts = torch.empty(sum(s * n for s, n in zip(splits, sizes)), device=x_TD.device, dtype=torch.float32)
    for (a, a_idx, b, b_idx, _, swiglu), grad, (cfg, split), part in zip(
            jobs, grads, cfgs, parts.split([s * n for s, n in zip(splits, sizes)])):  # fmt: skip
        _wgrad(a, a_idx, b, b_idx, grad, offs, cfg, split, swiglu=swiglu, partials=part)
    _sum_splits(parts, flat, sizes, splits)
    return dx, dw_M, *grads


# ----------------------------------------------------------------------------------------------------------------
# PyTorch ops: custom_op (fake implementations for torch.compile) + autograd


def _block_m(device: torch.device) -> int:
    return _config(device, "gemm")["BLOCK_M"]


@torch.library.custom_op("anyseek::moe_plan", mutates_args=())
def _plan_op(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> list[torch.Tensor]:
    return list(build_plan(topk_ids, num_experts, block_m))


@_plan_op.register_fake
def _(topk_ids, num_experts, block_m):
    M = topk_ids.numel()
    n_ub = triton.cdiv(M, block_m) + num_experts
    sizes = (M, M, num_experts + 1, n_ub, n_ub)
    return [topk_ids.new_empty(n, dtype=torch.int32) for n in sizes]


@torch.library.custom_op("anyseek::moe_experts_fwd", mutates_args=())
def _fwd_op(
    x: torch.Tensor, w: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, slot: torch.Tensor,
    tok: torch.Tensor, offs: torch.Tensor, tile_expert: torch.Tensor, tile_row: torch.Tensor, save: bool,
    add: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    return experts_fwd(x, w, gate_up, down, (slot, tok, offs, tile_expert, tile_row), save, add_TD=add)


@_fwd_op.register_fake
def _(x, w, gate_up, down, slot, tok, offs, tile_expert, tile_row, save, add=None):
    M, F = slot.shape[0], gate_up.shape[1]
    return x.new_empty(x.shape), x.new_empty(M if save else 0, F), x.new_empty(M, F // 2)


@torch.library.custom_op("anyseek::moe_experts_bwd", mutates_args=())
def _bwd_op(
    dy: torch.Tensor, x: torch.Tensor, w: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, h: torch.Tensor,
    act: torch.Tensor, slot: torch.Tensor, tok: torch.Tensor, offs: torch.Tensor, tile_expert: torch.Tensor,
    tile_row: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    return experts_bwd(dy, x, w, gate_up, down, h, act, (slot, tok, offs, tile_expert, tile_row))


@_bwd_op.register_fake
def _(dy, x, w, gate_up, down, h, act, slot, tok, offs, tile_expert, tile_row):
    return x.new_empty(x.shape), w.new_empty(w.shape, dtype=torch.float32), gate_up.new_empty(gate_up.shape), \
        down.new_empty(down.shape)  # fmt: skip


@torch.library.custom_op("anyseek::moe_experts_bwd_into", mutates_args=("dgu", "ddn"))
def _bwd_into_op(
    dy: torch.Tensor, x: torch.Tensor, w: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, h: torch.Tensor,
    act: torch.Tensor, slot: torch.Tensor, tok: torch.Tensor, offs: torch.Tensor, tile_expert: torch.Tensor,
    tile_row: torch.Tensor, dgu: torch.Tensor, ddn: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """As moe_experts_bwd, the weight gradients written into dgu and ddn (the trainer's flat gradient buffer)."""
    dx, dw, _, _ = experts_bwd(dy, x, w, gate_up, down, h, act, (slot, tok, offs, tile_expert, tile_row), dgu, ddn)
    return dx, dw


@_bwd_into_op.register_fake
def _(dy, x, w, gate_up, down, h, act, slot, tok, offs, tile_expert, tile_row, dgu, ddn):
    return x.new_empty(x.shape), w.new_empty(w.shape, dtype=torch.float32)


class _RoutedExperts(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_TD, topk_ids_TK, topk_weights_TK, gate_up_EFD, down_EDI, params, add_TD=None):
        ctx.params = params  # the weights as parameters, for their gradient destinations (or None)
        plan = torch.ops.anyseek.moe_plan(topk_ids_TK, gate_up_EFD.shape[0], _block_m(x_TD.device))
        w_M = topk_weights_TK.reshape(-1)
        save = any(ctx.needs_input_grad[:5])
        y_TD, h_MF, act_MI = torch.ops.anyseek.moe_experts_fwd(x_TD, w_M, gate_up_EFD, down_EDI, *plan, save, add_TD)
        ctx.save_for_backward(x_TD, w_M, gate_up_EFD, down_EDI, h_MF, act_MI, *plan)
        ctx.w_shape, ctx.w_dtype = topk_weights_TK.shape, topk_weights_TK.dtype
        return y_TD

    @staticmethod
    def backward(ctx, dy_TD):
        x_TD, w_M, gate_up_EFD, down_EDI, h_MF, act_MI, *plan = ctx.saved_tensors
        # ctx.params are the very tensors computed with: a destination (shaped and typed like them) takes the gradient
        dest = [kernels.grad_destination(p) for p in ctx.params] if ctx.params is not None else [None]
        if all(d is not None for d in dest):  # straight into the trainer's gradient buffer
            dgu, ddn = dest
            dx, dw_M = torch.ops.anyseek.moe_experts_bwd_into(
                dy_TD.contiguous(), x_TD, w_M, gate_up_EFD, down_EDI, h_MF, act_MI, *plan, dgu, ddn
            )
        else:
            dx, dw_M, dgu, ddn = torch.ops.anyseek.moe_experts_bwd(
                dy_TD.contiguous(), x_TD, w_M, gate_up_EFD, down_EDI, h_MF, act_MI, *plan
            )
        d_add = dy_TD if ctx.needs_input_grad[6] else None  # the addend's gradient is dy itself
        return dx, None, dw_M.view(ctx.w_shape).to(ctx.w_dtype), dgu, ddn, None, d_add


def _compute_dtype(x_TD: torch.Tensor) -> torch.dtype:
    """The dtype the experts compute in: autocast's where it is on (as it would cast a matmul's inputs), else x's."""
    kind = x_TD.device.type
    return torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else x_TD.dtype


class _LoRARoutedExperts(torch.autograd.Function):
    """Routed experts with frozen base weights and per-expert LoRA adapters (`experts_fwd_lora`): saved for backward
    are x, h and two [M, r] products (not the [M, I] SwiGLU output, recomputed from h); no effective weights."""

    @staticmethod
    def forward(ctx, x_TD, topk_ids_TK, topk_weights_TK, W_gu, W_dn, A_gu, B_gu, A_dn, B_dn, add_TD=None):
        plan = torch.ops.anyseek.moe_plan(topk_ids_TK, W_gu.shape[0], _block_m(x_TD.device))
        w_M = topk_weights_TK.reshape(-1)
        adapters = (A_gu, B_gu, A_dn, B_dn)
        y_TD, h_MF, act_MI, u_gu, u_dn = experts_fwd_lora(x_TD, w_M, W_gu, W_dn, adapters, plan, True, add_TD)
        ctx.save_for_backward(x_TD, w_M, W_gu, W_dn, *adapters, h_MF, u_gu, u_dn, *plan)
        ctx.w_shape, ctx.w_dtype = topk_weights_TK.shape, topk_weights_TK.dtype
        return y_TD

    @staticmethod
    def backward(ctx, dy_TD):
        x_TD, w_M, W_gu, W_dn, A_gu, B_gu, A_dn, B_dn, h_MF, u_gu, u_dn, *plan = ctx.saved_tensors
        dx, dw_M, *d_adapters = experts_bwd_lora(dy_TD.contiguous(), x_TD, w_M, W_gu, W_dn, h_MF, u_gu, u_dn, plan,
                                                 (A_gu, B_gu, A_dn, B_dn))  # fmt: skip
        d_add = dy_TD if ctx.needs_input_grad[9] else None  # the addend's gradient is dy itself
        return (dx, None, dw_M.view(ctx.w_shape).to(ctx.w_dtype), None, None, *d_adapters, d_add)


def lora_routed_experts(x_TD, topk_ids_TK, topk_weights_TK, gate_up_proj_EFD, down_proj_EDI, A_gu, B_gu, A_dn,
                        B_dn, scale: float, add_TD: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
    """Triton routed experts for LoRA (`anyseek.transforms.lora.LoRAExperts`): the frozen base gate_up [E, F, D] and
    down [E, D, I], adapters A_gu [E, r, D], B_gu [E, F, r], A_dn [E, r, I], B_dn [E, D, r]; the output equals
    `routed_experts` with the effective weights W + scale * B A, which are never formed. Gradients: x,
    topk_weights, the four adapters (the base gets none) and add_TD. add_TD ([T, D] or None) as in
    `routed_experts`: summed inside the combine where it has the dtype computed and returned in. -> [T, D] in x's
    dtype."""
    out_dtype = x_TD.dtype
    dtype = _compute_dtype(x_TD)
    with torch.autocast(x_TD.device.type, enabled=False):
        x, W_gu, W_dn, a_gu, a_dn = (t.to(dtype).contiguous() for t in (x_TD, gate_up_proj_EFD, down_proj_EDI, A_gu,
                                                                         A_dn))  # fmt: skip
        b_gu, b_dn = ((b * scale).to(dtype).contiguous() for b in (B_gu, B_dn))
        folded = _foldable(add_TD, dtype, out_dtype)
        y = _LoRARoutedExperts.apply(x, topk_ids_TK.contiguous(), topk_weights_TK.contiguous(), W_gu.detach(),
                                     W_dn.detach(), a_gu, b_gu, a_dn, b_dn, folded)  # fmt: skip
    return _with_addend(y, add_TD, folded, out_dtype)


def _foldable(add_TD: torch.Tensor | None, dtype: torch.dtype, out_dtype: torch.dtype) -> torch.Tensor | None:
    """The addend to sum inside the combine (contiguous): where it has the dtype the experts compute and return
    in; else None (it is added after, `_with_addend`)."""
    return add_TD.contiguous() if add_TD is not None and add_TD.dtype == dtype == out_dtype else None


def _with_addend(y: torch.Tensor, add_TD: torch.Tensor | None, folded: torch.Tensor | None, out_dtype) -> torch.Tensor:
    """The experts' output in out_dtype, plus the addend where the combine did not take it."""
    y = y.to(out_dtype)
    return y + add_TD if add_TD is not None and folded is None else y


def routed_experts(
    x_TD: torch.Tensor,
    topk_ids_TK: torch.Tensor,
    topk_weights_TK: torch.Tensor,
    gate_up_proj_EFD: torch.Tensor,
    down_proj_EDI: torch.Tensor,
    add_TD: torch.Tensor | None = None,
) -> torch.Tensor:
    """Triton routed experts; shapes and maths as `anyseek.kernels.routed_experts`. -> [T, D] in x's dtype.

    x, gate_up_proj and down_proj are computed in one dtype (under autocast: the autocast dtype, as autocast
    would cast them for a matmul); topk_weights may be any float dtype (read as fp32). add_TD ([T, D] or None):
    added to the output; where it has the dtype the experts compute and return in, inside the combine's fp32 sum
    (one rounding, no separate add)."""
    T, D = x_TD.shape
    E, F, D2 = gate_up_proj_EFD.shape
    if topk_ids_TK.shape != topk_weights_TK.shape or topk_ids_TK.dim() != 2 or topk_ids_TK.shape[0] != T:
        raise ValueError(
            f"routed_experts: topk_ids {tuple(topk_ids_TK.shape)} and topk_weights {tuple(topk_weights_TK.shape)} "
            f"must both be [T, K] with T = {T}"
        )
    if D2 != D or F % 2 or down_proj_EDI.shape != (E, D, F // 2):
        raise ValueError(
            f"routed_experts: gate_up_proj {tuple(gate_up_proj_EFD.shape)} must be [E, 2I, D] and down_proj "
            f"{tuple(down_proj_EDI.shape)} [E, D, I] with D = {D}"
        )
    out_dtype = x_TD.dtype
    dtype = _compute_dtype(x_TD)
    with torch.autocast(x_TD.device.type, enabled=False):
        x, gu, dn = (t.to(dtype).contiguous() for t in (x_TD, gate_up_proj_EFD, down_proj_EDI))
        # the weights as parameters, for their gradient destinations (kernels.set_grad_destination); not when
        # torch.compile traces the step (the destination is state outside the traced graph)
        same = gu is gate_up_proj_EFD and dn is down_proj_EDI and not torch.compiler.is_compiling()
        params = (gate_up_proj_EFD, down_proj_EDI) if same else None
        folded = _foldable(add_TD, dtype, out_dtype)  # (the seam checked its shape)
        y = _RoutedExperts.apply(x, topk_ids_TK.contiguous(), topk_weights_TK.contiguous(), gu, dn, params,
                                 folded)  # fmt: skip
    return _with_addend(y, add_TD, folded, out_dtype)


__all__ = ["build_plan", "build_plan_torch", "experts_bwd", "experts_bwd_lora", "experts_fwd", "experts_fwd_lora",
           "family", "lora_routed_experts", "routed_experts"]
