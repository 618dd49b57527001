"""Triton MLA decode over a paged latent cache: split-K flash-decoding, then a reduction over the splits.

Kernel 1, grid (T rows, head blocks, splits): each program takes BLOCK_H heads of one query row and a contiguous
range of that row's cached tokens (`pages_per_split` pages), walks it BLOCK_N tokens at a time through the block
table, and keeps an online softmax: s = q_lat . c_lat + q_pe . k_pe (two tensor-core dots over one loaded tile),
acc += p @ c_lat. It writes its normalized partial output and log-sum-exp (base 2) in fp32.
Kernel 2, grid (T, H): combines the splits' partials weighted by exp2(lse - max lse).

Splitting the sequence keeps every SM busy when rows x head blocks alone are too few (decode at small batch).
The latent tile is loaded once and used by both dots, so each cached byte is read once per head block.
Inputs as in `anyseek.kernels.mla_decode`. Shape legend: T rows, H heads, L kv_lora_rank, R rope dim, S splits.
"""

from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl

from anyseek.kernels.reference.decode import check_decode_shapes
from anyseek.kernels.triton import check
from anyseek.kernels.triton.launch import launch as _launch

LOG2E = 1.4426950408889634


@triton.jit(do_not_specialize=["pages_per_split"])
def _decode_split_kernel(
    Q, C, BT, LENS, O_part, LSE_part, scale_log2,
    stride_qt, stride_qh, stride_cb, stride_cp, stride_bt, stride_ot, stride_oh, stride_os, stride_lt, stride_lh,
    H, L, R, pages_per_split,
    PAGE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_R: tl.constexpr,
    BLOCK_N: tl.constexpr, IEEE: tl.constexpr,
):  # fmt: skip
    t, hb, sp = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    kv_len = tl.load(LENS + t)
    start = sp * pages_per_split * PAGE
    end = tl.minimum(start + pages_per_split * PAGE, kv_len)
    heads = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    hmask = heads < H
    offs_l, offs_r = tl.arange(0, BLOCK_L), tl.arange(0, BLOCK_R)
    lmask, rmask = offs_l < L, offs_r < R
    q_base = Q + t * stride_qt + heads[:, None] * stride_qh
    q_lat = tl.load(q_base + offs_l[None, :], mask=hmask[:, None] & lmask[None, :], other=0.0)
    q_pe = tl.load(q_base + L + offs_r[None, :], mask=hmask[:, None] & rmask[None, :], other=0.0)
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_L], tl.float32)
    for n0 in range(start, end, BLOCK_N):
        toks = n0 + tl.arange(0, BLOCK_N)
        tmask = toks < end
        page = tl.load(BT + t * stride_bt + toks // PAGE, mask=tmask, other=0).to(tl.int64)
        row = page * stride_cb + (toks % PAGE) * stride_cp
        c_lat = tl.load(C + row[:, None] + offs_l[None, :], mask=tmask[:, None] & lmask[None, :], other=0.0)
        k_pe = tl.load(C + row[:, None] + L + offs_r[None, :], mask=tmask[:, None] & rmask[None, :], other=0.0)
        if IEEE:
            s = tl.dot(q_lat, tl.trans(c_lat), input_precision="ieee")
            s += tl.dot(q_pe, tl.trans(k_pe), input_precision="ieee")
        else:
            s = tl.dot(q_lat, tl.trans(c_lat)) + tl.dot(q_pe, tl.trans(k_pe))
        s = tl.where(tmask[None, :], s * scale_log2, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.exp2(s - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        if IEEE:
            acc = acc * alpha[:, None] + tl.dot(p, c_lat.to(tl.float32), input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(c_lat.dtype), c_lat)
        m_i = m_new
    empty = l_i == 0.0
    out = acc / tl.where(empty, 1.0, l_i)[:, None]
    lse = tl.where(empty, float("-inf"), m_i + tl.log2(tl.where(empty, 1.0, l_i)))
    o_ptr = O_part + t * stride_ot + heads[:, None] * stride_oh + sp * stride_os + offs_l[None, :]
    tl.store(o_ptr, out, mask=hmask[:, None] & lmask[None, :])
    tl.store(LSE_part + t * stride_lt + heads * stride_lh + sp, lse, mask=hmask)


@triton.jit
def _decode_reduce_kernel(
    O_part, LSE_part, Out, stride_ot, stride_oh, stride_os, stride_lt, stride_lh, stride_t, stride_h, L, S,
    BLOCK_S: tl.constexpr, BLOCK_L: tl.constexpr,
):  # fmt: skip
    t, h = tl.program_id(0), tl.program_id(1)
    offs_s, offs_l = tl.arange(0, BLOCK_S), tl.arange(0, BLOCK_L)
    smask, lmask = offs_s < S, offs_l < L
    lse = tl.load(LSE_part + t * stride_lt + h * stride_lh + offs_s, mask=smask, other=float("-inf"))
    m = tl.max(lse, 0)
    w = tl.where(lse == float("-inf"), 0.0, tl.exp2(lse - tl.where(m == float("-inf"), 0.0, m)))
    o = tl.load(O_part + t * stride_ot + h * stride_oh + offs_s[:, None] * stride_os + offs_l[None, :],
                mask=smask[:, None] & lmask[None, :], other=0.0)  # fmt: skip
    out = tl.sum(o * w[:, None], 0) / tl.maximum(tl.sum(w, 0), 1e-30)
    tl.store(Out + t * stride_t + h * stride_h + offs_l, out.to(Out.dtype.element_ty), mask=lmask)


@functools.cache
def _device_limits(device: torch.device) -> tuple[int, int]:
    """(SM count, shared memory per block in bytes) of `device` (small made-up numbers on the CPU interpreter)."""
    if device.type != "cuda":
        return 4, 100 * 1024
    p = torch.cuda.get_device_properties(device)
    return p.multi_processor_count, getattr(p, "shared_memory_per_block_optin", 99 * 1024)


def launch_config(T: int, H: int, M: int, device: torch.device, dtype: torch.dtype, L: int = 512, R: int = 64) -> dict:
    """Head block, token tile, warps, stages and splits for T rows of H heads over tables of M pages.

    Measured on H100 and H200 (benchmarks/decode.py --sweep): 64-token tiles, 8 warps and 3 stages are best for 16
    and 128 heads (H200, H=16 B=64 4k: 3 stages 2.17 TB/s, 2 stages 2.11; H=128: 216 vs 207 TFLOP/s); splits: about
    one program per SM in all (H100, H=16, B=64, 4k: 2 splits 2.06 TB/s, 5 splits 1.74 TB/s). Triton keeps
    num_stages - 1 tiles in shared memory; where the estimate below is still too much, `_launch` lowers the stages
    at the first launch. Splits depend only on (T, H, M), never on the rows' actual lengths, so a CUDA-graph replay
    keeps its launch shape whatever the lengths are.
    """
    sms, smem = _device_limits(device)
    block_h = 16 if H <= 16 else (32 if H <= 32 else 64)
    head_blocks = triton.cdiv(H, block_h)
    splits = max(1, min(M, 64, sms // (T * head_blocks)))
    if dtype == torch.float32 or device.type != "cuda":
        return {"BLOCK_H": block_h, "BLOCK_N": 16, "num_warps": 4, "num_stages": 1, "splits": splits}
    width = (triton.next_power_of_2(L) + triton.next_power_of_2(R)) * 2  # bytes of one cached row
    block_n, stages = 64, 3

    def too_big() -> bool:  # Triton keeps num_stages - 1 tiles (at least one) in shared memory, plus ~16 KB
        return max(stages - 1, 1) * block_n * width + 16 * 1024 > smem

    while stages > 1 and too_big():
        stages -= 1
    while block_n > 16 and too_big():
        block_n //= 2
    return {"BLOCK_H": block_h, "BLOCK_N": block_n, "num_warps": 8, "num_stages": stages, "splits": splits}


def mla_decode(
    q_THX: torch.Tensor,
    cache_NPX: torch.Tensor,
    block_table_TM: torch.Tensor,
    kv_lens_T: torch.Tensor,
    kv_lora_rank: int,
    softmax_scale: float | None = None,
    config: dict | None = None,
) -> torch.Tensor:
    """See `anyseek.kernels.mla_decode`. `config` overrides `launch_config` (benchmarks sweep it)."""
    check_decode_shapes(q_THX, cache_NPX, block_table_TM, kv_lens_T, kv_lora_rank)
    if q_THX.dtype != cache_NPX.dtype:
        raise ValueError(f"mla_decode: q {q_THX.dtype} and cache {cache_NPX.dtype} must share a dtype")
    T, H, X = q_THX.shape
    P, L, R = cache_NPX.shape[1], kv_lora_rank, X - kv_lora_rank
    M = block_table_TM.shape[1]
    cfg = {**launch_config(T, H, M, q_THX.device, q_THX.dtype, L, R), **(config or {})}
    block_n = min(cfg["BLOCK_N"], P)
    if P % block_n or cache_NPX.stride(-1) != 1 or q_THX.stride(-1) != 1:
        raise ValueError(f"mla_decode: page size {P} must be a multiple of {block_n}; q and cache contiguous in X")
    S = cfg["splits"]
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(X)
    block_l, block_r = max(16, triton.next_power_of_2(L)), max(16, triton.next_power_of_2(R))
    o_part = torch.empty(T, H, S, L, device=q_THX.device, dtype=torch.float32)
    lse_part = torch.empty(T, H, S, device=q_THX.device, dtype=torch.float32)
    out = torch.empty(T, H, L, device=q_THX.device, dtype=q_THX.dtype)
    if T == 0:
        return out
    table = block_table_TM if block_table_TM.stride(-1) == 1 else block_table_TM.contiguous()
    grid = (T, triton.cdiv(H, cfg["BLOCK_H"]), S)
    launch = {"num_warps": cfg["num_warps"], "num_stages": cfg["num_stages"]}
    _launch(_decode_split_kernel, grid, launch)(
        q_THX, cache_NPX, table, kv_lens_T, o_part, lse_part, scale * LOG2E,
        q_THX.stride(0), q_THX.stride(1), cache_NPX.stride(0), cache_NPX.stride(1), table.stride(0),
        o_part.stride(0), o_part.stride(1), o_part.stride(2), lse_part.stride(0), lse_part.stride(1),
        H, L, R, triton.cdiv(M, S),
        PAGE=P, BLOCK_H=cfg["BLOCK_H"], BLOCK_L=block_l, BLOCK_R=block_r, BLOCK_N=block_n,
        IEEE=q_THX.dtype == torch.float32,
    )  # fmt: skip
    _decode_reduce_kernel[(T, H)](
        o_part, lse_part, out, o_part.stride(0), o_part.stride(1), o_part.stride(2), lse_part.stride(0),
        lse_part.stride(1), out.stride(0), out.stride(1), L, S,
        BLOCK_S=max(2, triton.next_power_of_2(S)), BLOCK_L=block_l, num_warps=4,
    )  # fmt: skip
    return out


def available(example: torch.Tensor) -> tuple[bool, str]:
    """(ok, reason) for the Triton decode kernel on tensors like `example` (q [T, H, L+R])."""
    ok, reason = check.available(example[..., : min(example.shape[-1], check.MAX_HEAD_DIM)])
    if not ok:
        return ok, reason
    if example.dtype == torch.bfloat16 and example.device.type == "cpu":
        return False, "bf16 is not supported by Triton's interpreter"
    return True, reason.replace("kernel", "decode kernel")
