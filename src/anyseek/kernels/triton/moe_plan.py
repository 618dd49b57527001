"""The routed experts' routing plan, built on the device without a host sync: the T*K (token, k) slots sorted by
expert (stable), each expert's first row, and the row-tile map the grouped GEMMs of `moe.py` run over (a counting
sort in three Triton kernels). `build_plan_torch` is its PyTorch twin (a stable sort), for the tests.

    plan      ids [T, K] -> rows sorted by expert (stable): slot [M], tok [M], offs [E+1], tile map [n_ub]

Shape legend: T tokens, K experts per token, M = T*K routed rows, E experts, n_ub = cdiv(M, block_m) + E row tiles.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# A stable counting sort in three kernels (torch.sort's radix sort, searchsorted and the tile arithmetic were ~12
# kernels and ~50 us per layer at 32k rows): the ids cut into S segments of SEG; (1) each program (e, s) counts
# expert e in segment s; (2) one program turns the [E, S] counts into each (e, s)'s first row (experts in order,
# segments in order within an expert), the expert offsets and the row-tile map; (3) each program (e, s) writes
# the rows of expert e in segment s at its first row on, in index order (a prefix sum over the segment). One
# segment of few experts (decoding: up to 256 routed rows beside 64 experts) takes one program for all three
# (`_plan_one_kernel`): on an H200 the three took ~9.4 us a 16B layer at batch 1, the scan alone 6.9.
_PLAN_SEGMENTS = 64  # S at most: the scan holds the [E, S] counts in one program


@triton.jit
def _plan_count_kernel(IDS, COUNTS, M, S, SEG: tl.constexpr):
    e = tl.program_id(0)
    s = tl.program_id(1)
    at = s * SEG + tl.arange(0, SEG)
    ids = tl.load(IDS + at, mask=at < M, other=-1)
    tl.store(COUNTS + e * S + s, tl.sum((ids == e).to(tl.int32), axis=0))


@triton.jit
def _store_tiles(TILE_E, TILE_ROW, re, tot, first, E, U, block_m, BU: tl.constexpr):
    """The row-tile map from each expert's rows (tot) and first row (first), over the experts re ([BE]): tile u's
    expert (-1 past the last tile) and first row. Tiles never straddle two experts."""
    tiles = tl.where(re < E, (tot + block_m - 1) // block_m, 0)
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
def _plan_scan_kernel(COUNTS, BASE, OFFS, TILE_E, TILE_ROW, E, S, U, block_m, BE: tl.constexpr, BS: tl.constexpr,
                      BU: tl.constexpr):
    re = tl.arange(0, BE)
    rs = tl.arange(0, BS)
    inside = (re[:, None] <= E) & (rs[None, :] < S)  # experts 0..E-1, then group E: the rows no expert takes
    c = tl.load(COUNTS + re[:, None] * S + rs[None, :], mask=inside, other=0)
    tot = tl.sum(c, axis=1)  # [BE] rows of each expert
    first = tl.cumsum(tot, axis=0) - tot  # offs[e]; offs[E]: the real experts' rows in all
    base = first[:, None] + tl.cumsum(c, axis=1) - c
    tl.store(BASE + re[:, None] * S + rs[None, :], base, mask=inside)
    tl.store(OFFS + re, first, mask=re <= E)
    _store_tiles(TILE_E, TILE_ROW, re, tot, first, E, U, block_m, BU)


@triton.jit
def _plan_one_kernel(IDS, SLOT, TOK, OFFS, TILE_E, TILE_ROW, M, E, U, block_m, K, SEG: tl.constexpr, BE: tl.constexpr,
                     BU: tl.constexpr):  # fmt: skip
    """The three kernels' work in one program, for at most SEG ids (decoding's few rows, where each of the three
    was a launch-bound few microseconds): the [experts, ids] one-hot gives the counts, each id's rank among its
    expert's (a prefix sum along the ids) and so its row; the tile map as `_plan_scan_kernel` makes it."""
    at = tl.arange(0, SEG)
    ids = tl.load(IDS + at, mask=at < M, other=-1)
    re = tl.arange(0, BE)
    hit = (ids[None, :] == re[:, None]).to(tl.int32)  # [BE, SEG]: experts 0..E-1, then group E (no expert)
    tot = tl.sum(hit, axis=1)
    first = tl.cumsum(tot, axis=0) - tot
    tl.store(OFFS + re, first, mask=re <= E)
    row = tl.sum(hit * (first[:, None] + tl.cumsum(hit, axis=1) - hit), axis=0)  # [SEG]: each id's row
    tl.store(SLOT + row, at, mask=at < M)
    tl.store(TOK + row, at // K, mask=at < M)
    _store_tiles(TILE_E, TILE_ROW, re, tot, first, E, U, block_m, BU)


ONE_KERNEL_CELLS = 32768  # the one-program plan while experts x ids (padded to powers of two) stay within this


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
    and first row. Tiles never straddle two experts. Ids lie in [0, E] (the router's top-k): E marks a slot no expert
    takes (expert parallelism's empty receive rows), placed after every expert's rows (offs[E] on) and in no tile."""
    ids_M = topk_ids_TK.reshape(-1).to(torch.int32)
    M, K, E = ids_M.numel(), max(topk_ids_TK.shape[-1], 1), num_experts
    dev = ids_M.device
    seg = max(256, triton.next_power_of_2(triton.cdiv(max(M, 1), _PLAN_SEGMENTS)))
    S = max(1, triton.cdiv(M, seg))
    U = triton.cdiv(M, block_m) + E
    i32 = dict(dtype=torch.int32, device=dev)
    slot, tok, offs = torch.empty(M, **i32), torch.empty(M, **i32), torch.empty(E + 1, **i32)
    tile_expert, tile_row = torch.empty(U, **i32), torch.empty(U, **i32)
    BE = triton.next_power_of_2(E + 1)
    if S == 1 and BE * seg <= ONE_KERNEL_CELLS:
        _plan_one_kernel[(1,)](ids_M, slot, tok, offs, tile_expert, tile_row, M, E, U, block_m, K, SEG=seg, BE=BE,
                               BU=max(16, min(128, 8192 // BE)), num_warps=8)  # fmt: skip
        return slot, tok, offs, tile_expert, tile_row
    counts, base = torch.empty(E + 1, S, **i32), torch.empty(E + 1, S, **i32)
    warps = 4 if seg <= 1024 else 8
    _plan_count_kernel[(E + 1, S)](ids_M, counts, M, S, SEG=seg, num_warps=warps)
    BS = triton.next_power_of_2(S)
    _plan_scan_kernel[(1,)](counts, base, offs, tile_expert, tile_row, E, S, U, block_m, BE=BE, BS=BS,
                            BU=max(16, min(128, 8192 // BE)), num_warps=8)
    _plan_place_kernel[(E + 1, S)](ids_M, base, slot, tok, M, S, K, SEG=seg, num_warps=warps)
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


__all__ = ["build_plan", "build_plan_torch"]
