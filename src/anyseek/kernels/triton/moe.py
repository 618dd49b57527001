"""Triton routed experts: launch settings, the launchers of the grouped GEMMs (`moe_gemm.py`'s kernels) with fused
gather / SwiGLU / scatter, and the experts' forward and backward over a routing plan (`moe_plan.py`), with a
deterministic fp32 combine. The LoRA experts build on these in `moe_lora.py`; the PyTorch ops (custom ops, fake
implementations, autograd) are in `kernels/ops/moe.py`.

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

import os

import torch
import triton
import triton.language as tl

from anyseek.kernels.reference.quant4 import GROUP, in_features
from anyseek.kernels.triton import moe_family
from anyseek.kernels.triton.launch import launch as _launch
from anyseek.kernels.triton.moe_gemm import (
    EPI_DSWIGLU,
    EPI_PLAIN,
    EPI_SWIGLU,
    _grouped_gemm_kernel,
    _grouped_wgrad_kernel,
)
from anyseek.kernels.triton.quant4_dq import dequantize, dq_mode, nf4_lut

# Launch settings per GPU family: (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages). "gemm" serves the plain and
# the dSwiGLU epilogues, "swiglu" the forward GEMM with two accumulators (gate and up), "wgrad" the weight
# gradients, "lora_dx" LoRA's dx GEMM (`moe_lora.py`). BLOCK_M must be equal in "gemm", "swiglu", "dswiglu" and
# "lora_dx": the routing plan's row tiles serve all.
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
# "lora_dx" is the plain GEMM with LoRA's rank-r product g_gu = dh B_gu formed in its loop over K (a second dot; it
# reads B_gu k-major, a transposed copy [E, r, F], 2.8 us): with 8 warps that dot costs 25-33 us less than with
# "gemm"'s 16 (H200, small, 8k, skewed routing: 188-198 -> 155-173 us; plain dx 130-153 in the same runs; 16 warps
# or B_gu as it lies, [E, F, r], gain nothing). Kept in the loop: given by a narrow pass over dh first, as the other
# three LoRA GEMMs get theirs, the dx GEMM took 180-189 us plus 28 for the pass against 194-200 (H100, small, 8k).
# Elsewhere "gemm"'s settings (not measured).
# "small_swiglu" and "small_gemm" are the forward's two GEMMs without gradients at few rows (decoding: at most
# SMALL_ROWS routed rows, a handful per expert). There the weights' bytes are the whole cost (the 16B shape at batch
# 64 reads every expert: 1.1 GB a layer), and 128-row tiles leave most SMs idle at batch 1 (6 experts x 11 column
# blocks: 66 programs), so narrow row tiles and more column blocks. BLOCK_M equal in both (their own plan). Swept
# on an H200 (benchmarks/moe_decode.py --sweep, 16B experts, one layer of 8 in a CUDA graph, plan included): us a
# layer at batch 1 / 8 / 64 / 170, training settings 98.9 / 264.1 / 383.2 / 377.5 -> these 51.4 / 177.4 / 285.2 /
# 322.3 (floor 21.6 / 137 / 231 / 231: the chosen experts' bytes at 4.8 TB/s). With 16-row tiles the other
# candidates (32-128 columns, K steps of 128-256, 3-6 stages, 4 or 8 warps) were within 10%; 64-row tiles 25-70%
# slower. Elsewhere not measured (the same shape of settings, smaller K steps).
_TABLE = {
    "hopper": {"gemm": (128, 256, 64, 16, 4), "swiglu": (128, 128, 64, 8, 3), "wgrad": (128, 128, 64, 8, 6),
               "dswiglu": (128, 128, 64, 16, 4), "lora_dx": (128, 256, 64, 8, 4),
               "small_swiglu": (16, 32, 256, 4, 3), "small_gemm": (16, 128, 128, 4, 4)},
    "ampere_dc": {"gemm": (128, 128, 32, 8, 4), "swiglu": (128, 64, 32, 8, 4), "wgrad": (128, 128, 32, 8, 4),
                  "dswiglu": (128, 64, 32, 8, 4), "lora_dx": (128, 128, 32, 8, 4),
                  "small_swiglu": (16, 32, 128, 4, 4), "small_gemm": (16, 64, 128, 4, 4)},
    "consumer": {"gemm": (128, 64, 32, 4, 3), "swiglu": (128, 32, 32, 4, 3), "wgrad": (64, 128, 32, 4, 3),
                 "dswiglu": (128, 32, 32, 4, 3), "lora_dx": (128, 64, 32, 4, 3),
                 "small_swiglu": (16, 32, 64, 4, 3), "small_gemm": (16, 64, 64, 4, 3)},
    "interpreter": {"gemm": (16, 16, 16, 1, 1), "swiglu": (16, 16, 16, 1, 1), "wgrad": (16, 16, 16, 1, 1),
                    "dswiglu": (16, 16, 16, 1, 1), "lora_dx": (16, 16, 16, 1, 1),
                    "small_swiglu": (32, 16, 16, 1, 1), "small_gemm": (32, 32, 16, 1, 1)},
}
SMALL_ROWS = 1024  # routed rows (T*K) up to which a forward without gradients takes the "small_" settings
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
# launchers


QUANT4_CHUNK_BYTES = 96 << 20  # the 4-bit experts' pre-pass: at most this much of them in bf16 at once
PREPASS_ROWS_PER_EXPERT = 128  # ... taken from this many routed rows an expert on average (ANYSEEK_QUANT4_EXPERTS)


def _prepass(M: int, E: int) -> bool:
    """Whether a grouped GEMM over 4-bit experts (M routed rows, E experts) dequantizes them first, a chunk of experts
    at a time (`_gemm_prepass`), or inside the GEMM. ANYSEEK_QUANT4_EXPERTS: `auto` (default): the pre-pass while a
    CUDA graph is being captured, from PREPASS_ROWS_PER_EXPERT rows an expert on average; `fused`, `prepass`: always
    that route; anything else is an error naming the choices.

    Why: the fused GEMM dequantizes each weight tile once per row tile of its expert, the pre-pass once, but it
    launches ~3 kernels a chunk. On an H200 (16B experts at 4,096 tokens: 384 rows an expert) dequantize + the bf16
    grouped GEMM took 0.39-0.73x the best fused kernel's time on all four GEMMs (stop 47, quant4_gemm.py), and the
    16B LoRA trainer step with its forward and backward in one CUDA graph 338 -> 248 ms (bf16 base: 187). Eager,
    where every launch costs host time, the same step went 555 -> 811 ms: there the fused kernel stays."""
    route = os.environ.get("ANYSEEK_QUANT4_EXPERTS", "auto")
    if route not in ("auto", "fused", "prepass"):
        raise ValueError(f"ANYSEEK_QUANT4_EXPERTS={route!r}: choose auto, fused or prepass")
    if route != "auto":
        return route == "prepass"
    return M >= PREPASS_ROWS_PER_EXPERT * E and torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def _gemm_prepass(a, b_e, strides_b, c, plan, N, K_red, cfg, low_rank=None, l_token=None, **kw):
    """`_gemm` over a packed 4-bit stack b_e, a chunk of experts at a time: the chunk dequantized to A's dtype (at
    most QUANT4_CHUNK_BYTES), then the bf16 GEMM over the tiles of its experts (the tile map renumbered from the
    chunk's first expert; the offsets, the LoRA terms and the per-token products read from there on)."""
    slot, tok, offs, tile_expert, tile_row = plan
    E, k_in = b_e.shape[0], strides_b[1] == 1  # (k along the packed rows: the forward's B^T)
    per = max(1, QUANT4_CHUNK_BYTES // (b_e.shape[1] * in_features(b_e) * a.element_size()))
    r = 0 if low_rank is None else low_rank[0].shape[1]
    for lo in range(0, E, per):
        hi = min(E, lo + per)
        W = dequantize(b_e[lo:hi], a.dtype)
        tiles = torch.where((tile_expert >= lo) & (tile_expert < hi), tile_expert - lo, -1)
        low = None if low_rank is None else (low_rank[0], low_rank[1][lo:hi], low_rank[2], low_rank[3][lo:hi],
                                             low_rank[4])  # fmt: skip
        _gemm(a, W, _nk(W) if k_in else _kn(W), c, (slot, tok, offs[lo:], tiles, tile_row), N, K_red, cfg,
              low_rank=low, l_token=None if l_token is None else l_token[:, lo * r:], **kw)  # fmt: skip


def _gemm(a, b_e, strides_b, c, plan, N, K_red, cfg, *, gather=False, scatter=False, epi=EPI_PLAIN, h=None,
          w=None, dw=None, save_h=False, up_cols=0, low_rank=None, l_token=None, l_rows=False):  # fmt: skip
    """C[r] = A[row(r)] @ B_e over the plan's row tiles (see `_grouped_gemm_kernel`). low_rank = (L [M, r], P [E, ...],
    P's strides as (expert, k, n), R [E, ...], R's strides): C[r] = A[row(r)] @ (B_e + P_e R_e), and L (row order)
    receives A[row(r)] @ P_e. Or, instead of forming that product in the loop (P then unread): l_token (gathered A
    only), A @ P_e for every token and expert, [T, E*r] (`_per_token`); l_rows, L already holds it (`_narrow`).
    A packed 4-bit b_e: dequantized in the loop over K, or first, a chunk of experts at a time (`_prepass`)."""
    if b_e.dtype == torch.uint8 and _prepass(plan[0].numel(), b_e.shape[0]):
        return _gemm_prepass(a, b_e, strides_b, c, plan, N, K_red, cfg, gather=gather, scatter=scatter, epi=epi,
                             h=h, w=w, dw=dw, save_h=save_h, up_cols=up_cols, low_rank=low_rank, l_token=l_token,
                             l_rows=l_rows)  # fmt: skip
    slot, tok, offs, tile_expert, tile_row = plan
    n_m = tile_expert.numel()
    h = c if h is None else h
    grid = (n_m * triton.cdiv(N, cfg["BLOCK_N"]),)
    l_, p_, strides_p, r_, strides_r = low_rank if low_rank is not None else (c, c, (0, 0, 0), c, (0, 0, 0))
    rank = l_.shape[1] if low_rank is not None else 0
    l_mode = 2 if l_rows else 0
    quant = b_e.dtype == torch.uint8  # a packed 4-bit stack (quant4_moe.py): k along its rows where strides_b[1] == 1
    q_args = (b_e.view(torch.int16), nf4_lut(b_e.device), b_e.stride(1), in_features(b_e) // 4) if quant \
        else (c, c, 0, 0)
    if l_token is not None:
        assert gather and low_rank is not None and l_token.stride(1) == 1, "l_token: gathered rows, a rank-r term"
        p_, strides_p, l_mode = l_token, (0, l_token.stride(0), 1), 1
    _launch(_grouped_gemm_kernel, grid, cfg)(
        a, tok, slot, b_e, c, h, c if w is None else w, c if dw is None else dw, offs, tile_expert, tile_row,
        n_m, N, K_red, a.stride(0), *strides_b, c.stride(0), h.stride(0), up_cols,
        l_, p_, r_, l_.stride(0), *strides_p, *strides_r, rank, *q_args,
        GATHER_A=gather, SCATTER_C=scatter, EPI=epi, SAVE_H=save_h, EVEN_K=K_red % cfg["BLOCK_K"] == 0,
        EVEN_N=N % cfg["BLOCK_N"] == 0, LORA=low_rank is not None, L_MODE=l_mode,
        RANK=_rank_block(rank), PREC=_prec(a.dtype), QUANT=quant, Q_K_IN=quant and strides_b[1] == 1, Q_GROUP=GROUP,
        Q_DQ=dq_mode() if quant else 4,
    )  # fmt: skip


def _narrow(a, P, strides_p, plan, K_red: int, out_Mr: torch.Tensor) -> torch.Tensor:
    """out [M, r] = A[row] @ P_e (row order, A not gathered): the grouped GEMM with N = r, one narrow pass over A,
    so that the wide GEMM after it reads L in its epilogue (`_gemm(l_rows=True)`) instead of a second dot in its
    loop over K (small, 8k, H200: that dot made the down GEMM 92 -> 120 us and dx 154 -> 200; this pass takes 9 and
    21 us; LoRA's dx keeps its dot all the same: see "lora_dx" in _TABLE)."""
    r = out_Mr.shape[1]
    cfg = {**_config(a.device, "gemm"), "BLOCK_N": _rank_block(r), "num_warps": 4}
    _gemm(a, P, strides_p, out_Mr, plan, r, K_red, cfg)
    return out_Mr


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


def sum_k(rows_MD: torch.Tensor, T: int, dtype: torch.dtype, add_TD: torch.Tensor | None = None) -> torch.Tensor:
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


def narrow_tiles(M: int, save: bool) -> bool:
    """Whether the forward of M routed rows takes the "small_" launch settings (and a plan of their BLOCK_M)."""
    return not save and M <= SMALL_ROWS


def block_m(device: torch.device, narrow: bool = False) -> int:
    """The row tile the routing plan is built for: the grouped GEMMs' (all equal), or the "small_" ones'."""
    return _config(device, "small_gemm" if narrow else "gemm")["BLOCK_M"]


def experts_fwd(x_TD, w_M, gate_up_EFD, down_EDI, plan, save: bool, low_gu=None, low_dn=None, add_TD=None,
                l_token_gu=None, narrow: bool = False):  # fmt: skip
    """-> y [T, D] (+ add_TD, a contiguous [T, D] addend, when given), h [M, F] (pre-activations, empty unless
    save), act [M, I] (weighted SwiGLU output). low_gu / low_dn: the two GEMMs' rank-r terms (see `_gemm`; LoRA,
    `experts_fwd_lora`); l_token_gu: the first one's products per token (`_gemm`'s l_token); the second one's are
    made by a narrow pass first (`_narrow`). narrow: the "small_" settings (`narrow_tiles`; the plan built for
    their `block_m`)."""
    T, D = x_TD.shape
    F = gate_up_EFD.shape[1]
    I = F // 2
    M = plan[0].numel()
    act_MI = x_TD.new_empty(M, I)
    h_MF = x_TD.new_empty(M if save else 0, F)
    if M == 0:
        return (x_TD.new_zeros(T, D) if add_TD is None else add_TD.clone()), h_MF, act_MI
    pre = "small_" if narrow else ""
    _gemm(x_TD, gate_up_EFD, _nk(gate_up_EFD), act_MI, plan, I, D, _config(x_TD.device, pre + "swiglu"), gather=True,
          epi=EPI_SWIGLU, h=h_MF if save else None, w=w_M, save_h=save, up_cols=I, low_rank=low_gu,
          l_token=l_token_gu)  # fmt: skip
    y_slot_MD = x_TD.new_empty(M, D)
    if low_dn is not None:
        _narrow(act_MI, low_dn[1], low_dn[2], plan, I, low_dn[0])
    _gemm(act_MI, down_EDI, _nk(down_EDI), y_slot_MD, plan, D, I, _config(x_TD.device, pre + "gemm"), scatter=True,
          low_rank=low_dn, l_rows=low_dn is not None)  # fmt: skip
    return sum_k(y_slot_MD, T, x_TD.dtype, add_TD), h_MF, act_MI


def _dh(dy_TD, w_M, down_EDI, h_MF, plan, low_rank=None, l_token=None):
    """The backward's first pass: dh [M, F] (the gradient at the gate|up pre-activations, through the weighted
    SwiGLU) and dw [M] (the routing weights' gradient, slot order, fp32). low_rank, l_token: see `_gemm` (LoRA)."""
    M, F = plan[0].numel(), h_MF.shape[1]
    I = F // 2
    gemm = _config(dy_TD.device, "dswiglu")
    dh_MF = dy_TD.new_empty(M, F)
    # zeros: the rows of slots no expert takes (id E) are in no tile
    dw_parts = torch.zeros(M, triton.cdiv(I, gemm["BLOCK_N"]), device=dy_TD.device, dtype=torch.float32)
    dn = down_EDI
    if M:
        _gemm(dy_TD, dn, _kn(dn), dh_MF, plan, I, dy_TD.shape[1], gemm,
              gather=True, epi=EPI_DSWIGLU, h=h_MF, w=w_M, dw=dw_parts, up_cols=I, low_rank=low_rank,
              l_token=l_token)  # fmt: skip
    dw_M = torch.empty(M, device=dy_TD.device, dtype=torch.float32)
    dw_M[plan[0].long()] = dw_parts.sum(1)
    return dh_MF, dw_M


def _dx(dh_MF, x_TD, gate_up_EFD, plan, low_rank=None):
    """dx [T, D] = the K slots' dh @ gate_up of their experts, summed per token. low_rank: see `_gemm` (LoRA: the
    rank-r product formed in the loop over K, with the "lora_dx" launch settings)."""
    T, D = x_TD.shape
    M, F = dh_MF.shape
    if not M:
        return torch.zeros_like(x_TD)
    gu = gate_up_EFD
    dx_slot_MD = x_TD.new_empty(M, D)
    cfg = _config(x_TD.device, "gemm" if low_rank is None else "lora_dx")
    _gemm(dh_MF, gu, _kn(gu), dx_slot_MD, plan, D, F, cfg, scatter=True, low_rank=low_rank)
    return sum_k(dx_slot_MD, T, x_TD.dtype)


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


__all__ = ["experts_bwd", "experts_fwd", "family"]
