"""Triton MLA decode over a paged latent cache: split-K flash-decoding, then a reduction over the splits.

Kernel 1, grid (T rows, head blocks, splits): each program takes BLOCK_H heads of one query row and a contiguous
range of that row's cached tokens (`pages_per_split` pages), walks it BLOCK_N tokens at a time through the block
table, and keeps an online softmax: s = q_lat . c_lat + q_pe . k_pe (tensor-core dots over one loaded tile),
acc += p @ c_lat. It writes its normalized partial output and log-sum-exp (base 2) in fp32 (with one split: the
output itself, and kernel 2 does not run). The latent is held as two halves (two [BLOCK_N, HALF] tiles, two
accumulators): a TMA box is at most 256 columns wide, and DeepSeek's latent is 512. On Hopper and later whole
tiles arrive by TMA, through descriptors the kernel builds on the device (`tl.make_tensor_descriptor`; descriptors
built on the host cost Triton 3.6 ~50-200 us of host time per eager launch). The copy engine computes the
addresses, so the threads' registers go to the 64 x 512 fp32 accumulator (H=128, B=64, 4k on H100: 216 -> 262
TFLOP/s). The last partial tile of a range, and every tile where TMA is not used, is loaded through pointers with a
mask: slots past a row's length are never read. If the first TMA launch of a kernel variant on a device fails (a
Triton or driver that cannot build it), a warning says so and that variant uses pointers there.
Kernel 2, grid (T, H): combines the splits' partials weighted by exp2(lse - max lse).

Splitting the sequence keeps every SM busy when rows x head blocks alone are too few (decode at small batch).
The latent tile is loaded once and used by both dots, so each cached byte is read once per head block.
Inputs as in `anyseek.kernels.mla_decode`. Shape legend: T rows, H heads, L kv_lora_rank, R rope dim, S splits.
"""

from __future__ import annotations

import functools
import math
import os
import warnings

import torch
import triton
import triton.language as tl

from anyseek.kernels.reference.decode import check_decode_shapes
from anyseek.kernels.triton import check, mla_decode_ws
from anyseek.kernels.triton.launch import launch as _launch

LOG2E = 1.4426950408889634


@triton.jit
def _online_softmax_step(s, c0, c1, acc0, acc1, m_i, l_i, IEEE: tl.constexpr):
    """One tile of the online softmax: s [BLOCK_H, BLOCK_N] (base-2 logits, masked ones -inf), c0 / c1 the tile's
    two latent halves [BLOCK_N, HALF]; returns acc0, acc1, m_i, l_i updated."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    if IEEE:
        acc0 = tl.dot(p, c0.to(tl.float32), acc0 * alpha[:, None], input_precision="ieee")
        acc1 = tl.dot(p, c1.to(tl.float32), acc1 * alpha[:, None], input_precision="ieee")
    else:
        acc0 = tl.dot(p.to(c0.dtype), c0, acc0 * alpha[:, None])
        acc1 = tl.dot(p.to(c1.dtype), c1, acc1 * alpha[:, None])
    return acc0, acc1, m_new, l_i


@triton.jit(do_not_specialize=["pages_per_split"])
def _decode_split_kernel(
    Q, C, BT, LENS, O_part, LSE_part, scale_log2,
    stride_qt, stride_qh, stride_cb, stride_cp, stride_bt, stride_ot, stride_oh, stride_os, stride_lt, stride_lh,
    H, pages_per_split, n_rows, X,
    L: tl.constexpr, R: tl.constexpr, PAGE: tl.constexpr, BLOCK_H: tl.constexpr, HALF: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr, TMA: tl.constexpr,
):  # fmt: skip
    t, hb, sp = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    kv_len = tl.load(LENS + t)
    start = sp * pages_per_split * PAGE
    end = tl.minimum(start + pages_per_split * PAGE, kv_len)
    heads = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    hmask = heads < H
    offs_l, offs_r = tl.arange(0, HALF), tl.arange(0, BLOCK_R)
    lmask0, lmask1, rmask = offs_l < L, offs_l + HALF < L, offs_r < R
    q_base = Q + t * stride_qt + heads[:, None] * stride_qh
    q0 = tl.load(q_base + offs_l[None, :], mask=hmask[:, None] & lmask0[None, :], other=0.0)
    q1 = tl.load(q_base + HALF + offs_l[None, :], mask=hmask[:, None] & lmask1[None, :], other=0.0)
    qp = tl.load(q_base + L + offs_r[None, :], mask=hmask[:, None] & rmask[None, :], other=0.0)
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc0 = tl.zeros([BLOCK_H, HALF], tl.float32)
    acc1 = tl.zeros([BLOCK_H, HALF], tl.float32)
    tail = start
    if TMA:  # whole tiles: one tensor-memory-accelerator copy per operand, no address or mask arithmetic
        lat_desc = tl.make_tensor_descriptor(C, [n_rows, L], [X, 1], [BLOCK_N, HALF])
        pe_desc = tl.make_tensor_descriptor(C + L, [n_rows, R], [X, 1], [BLOCK_N, BLOCK_R])
        tail = start + (end - start) // BLOCK_N * BLOCK_N
        for n0 in range(start, tail, BLOCK_N):
            row = tl.load(BT + t * stride_bt + n0 // PAGE) * PAGE + n0 % PAGE
            c0 = lat_desc.load([row, 0])
            c1 = lat_desc.load([row, HALF])
            kp = pe_desc.load([row, 0])
            s = tl.dot(qp, tl.trans(kp), tl.dot(q1, tl.trans(c1), tl.dot(q0, tl.trans(c0))))
            acc0, acc1, m_i, l_i = _online_softmax_step(s * scale_log2, c0, c1, acc0, acc1, m_i, l_i, IEEE)
    for n0 in range(tail, end, BLOCK_N):  # without TMA every tile, with it the last partial one (masked to zero)
        toks = n0 + tl.arange(0, BLOCK_N)
        tmask = toks < end
        page = tl.load(BT + t * stride_bt + toks // PAGE, mask=tmask, other=0).to(tl.int64)
        row = page * stride_cb + (toks % PAGE) * stride_cp
        c0 = tl.load(C + row[:, None] + offs_l[None, :], mask=tmask[:, None] & lmask0[None, :], other=0.0)
        c1 = tl.load(C + row[:, None] + HALF + offs_l[None, :], mask=tmask[:, None] & lmask1[None, :], other=0.0)
        kp = tl.load(C + row[:, None] + L + offs_r[None, :], mask=tmask[:, None] & rmask[None, :], other=0.0)
        if IEEE:
            s = tl.dot(q0, tl.trans(c0), input_precision="ieee")
            s = tl.dot(q1, tl.trans(c1), s, input_precision="ieee")
            s = tl.dot(qp, tl.trans(kp), s, input_precision="ieee")
        else:
            s = tl.dot(qp, tl.trans(kp), tl.dot(q1, tl.trans(c1), tl.dot(q0, tl.trans(c0))))
        s = tl.where(tmask[None, :], s * scale_log2, float("-inf"))
        acc0, acc1, m_i, l_i = _online_softmax_step(s, c0, c1, acc0, acc1, m_i, l_i, IEEE)
    empty = l_i == 0.0
    inv = 1.0 / tl.where(empty, 1.0, l_i)
    lse = tl.where(empty, float("-inf"), m_i + tl.log2(tl.where(empty, 1.0, l_i)))
    o_ptr = O_part + t * stride_ot + heads[:, None] * stride_oh + sp * stride_os + offs_l[None, :]
    o_ty = O_part.dtype.element_ty  # fp32 partials, or the output itself when there is one split
    tl.store(o_ptr, (acc0 * inv[:, None]).to(o_ty), mask=hmask[:, None] & lmask0[None, :])
    tl.store(o_ptr + HALF, (acc1 * inv[:, None]).to(o_ty), mask=hmask[:, None] & lmask1[None, :])
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
def _device_limits(device: torch.device) -> tuple[int, int, bool, bool]:
    """(SM count, shared memory per block in bytes, has TMA, is Hopper sm_90) of `device` (small made-up numbers on
    the CPU interpreter, which runs tensor descriptors too)."""
    if device.type != "cuda":
        return 4, 100 * 1024, True, False
    p = torch.cuda.get_device_properties(device)
    smem = getattr(p, "shared_memory_per_block_optin", 99 * 1024)
    return p.multi_processor_count, smem, p.major >= 9, (p.major, p.minor) == (9, 0)


# Triton's interpreter (decided once, when Triton reads the variable at import) runs kernels on CPU tensors
_SCRATCH_DEVICE = "cpu" if os.environ.get("TRITON_INTERPRET") == "1" else "cuda"


def _scratch(size: int, alignment: int, stream) -> torch.Tensor:
    """Triton's workspace for the descriptors a kernel builds on the device (128 bytes per program and descriptor)."""
    return torch.empty(size, dtype=torch.int8, device=_SCRATCH_DEVICE)


# per device and kernel variant: True once a TMA launch worked, a reason string after one failed (then pointers)
_TMA_STATE: dict[tuple, bool | str] = {}


def _tma_supported() -> bool:
    """Whether this Triton builds tensor descriptors inside kernels (they need a workspace allocator)."""
    return hasattr(tl, "make_tensor_descriptor") and hasattr(triton, "set_allocator")


def _ensure_allocator() -> None:
    """Give Triton a workspace allocator where this thread has none (Triton keeps it per thread context). One the
    user set is kept: only Triton's default, which refuses every request, is replaced."""
    try:
        from triton.runtime import _allocation

        if not isinstance(_allocation._allocator.get(), _allocation.NullAllocator):
            return
    except (ImportError, AttributeError):  # another Triton layout: set ours
        pass
    triton.set_allocator(_scratch)


def _tile_widths(L: int, R: int) -> tuple[int, int]:
    """(HALF, BLOCK_R): the latent is read as two halves of HALF columns, the rope part as BLOCK_R columns."""
    return max(16, triton.next_power_of_2(L) // 2), max(16, triton.next_power_of_2(R))


def launch_config(T: int, H: int, M: int, device: torch.device, dtype: torch.dtype, L: int = 512, R: int = 64) -> dict:
    """Head block, token tile, warps, stages, splits and TMA use for T rows of H heads over tables of M pages.

    Measured on H100 (benchmarks/decode.py --sweep; scratch sweeps of the TMA version, 2026-11-25): 64-token tiles
    and 8 warps for 16 and 128 heads; with TMA loads, 2 stages for 128 heads (H=128, B=64, 4k: 262 TFLOP/s, 3 stages
    244, 32-token tiles 175, 16 warps <= 118: they spill) and 3 for 16. Splits: about one program per SM (H100,
    H=16, B=64, 4k: 2 splits 2.06 TB/s, 5 splits 1.74 TB/s). TMA (Hopper and later, 16-bit caches whose latent and
    rope widths are powers of two) copies each whole tile with one instruction per operand and no per-element address
    or mask work; elsewhere the same kernel loads through pointers. Where the shared-memory estimate below is still
    too much, `_launch` lowers the stages at the first launch. Splits depend only on (T, H, M), never on the rows'
    actual lengths, so a CUDA-graph replay keeps its launch shape whatever the lengths are.
    """
    sms, smem, has_tma, hopper = _device_limits(device)
    block_h = 16 if H <= 16 else (32 if H <= 32 else 64)
    head_blocks = triton.cdiv(H, block_h)
    splits = max(1, min(M, 64, sms // (T * head_blocks)))
    half, block_r = _tile_widths(L, R)
    tma = has_tma and 2 * half == L and block_r == R and _tma_supported()  # (then L + R is a multiple of 16 too)
    if dtype == torch.float32 or device.type != "cuda":
        return {"BLOCK_H": block_h, "BLOCK_N": 16, "num_warps": 4, "num_stages": 1, "splits": splits,
                "tma": tma and dtype != torch.float32}  # fmt: skip
    width = (2 * half + block_r) * 2  # bytes of one cached row
    block_n, stages = 64, (3 if H <= 16 else 2)

    def too_big() -> bool:  # Triton keeps num_stages - 1 tiles (at least one) in shared memory, plus ~16 KB
        return max(stages - 1, 1) * block_n * width + 16 * 1024 > smem

    while stages > 1 and too_big():
        stages -= 1
    while block_n > 16 and too_big():
        block_n //= 2
    # 64-head blocks on Hopper: the warp-specialised Gluon kernel (mla_decode_ws.py), where it builds
    ws = hopper and mla_decode_ws.unsupported(H, L, R, dtype) is None
    return {"BLOCK_H": block_h, "BLOCK_N": block_n, "num_warps": 8, "num_stages": stages, "splits": splits, "tma": tma,
            "ws": ws}  # fmt: skip


def _try_variant(key: tuple, run, message: str) -> bool:
    """Run a kernel variant that may not build here (TMA loads, the Gluon kernel): True once it ran. Its first
    failure on a device is remembered under `key` and a warning (`message`, with the reason) says so once; it is not
    tried there again. After it has worked once, an error is a real one and propagates."""
    verdict = _TMA_STATE.get(key)  # None: not tried yet; True: works; a reason: failed
    if isinstance(verdict, str):
        return False
    try:
        run()
    except Exception as e:  # noqa: BLE001 - where this Triton or driver cannot build it: the next variant instead
        if verdict:
            raise
        _TMA_STATE[key] = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
        warnings.warn("anyseek: " + message.format(reason=_TMA_STATE[key]), RuntimeWarning, stacklevel=3)
        return False
    _TMA_STATE[key] = True
    return True


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
    half, block_r = _tile_widths(L, R)
    out = torch.empty(T, H, L, device=q_THX.device, dtype=q_THX.dtype)
    # one split: the split kernel's normalized output is the answer; it writes `out` itself (no fp32 partials, no
    # reduction launch; the values are the same, rounded once)
    o_part = out.unsqueeze(2) if S == 1 else torch.empty(T, H, S, L, device=q_THX.device, dtype=torch.float32)
    lse_part = torch.empty(T, H, S, device=q_THX.device, dtype=torch.float32)
    if T == 0:
        return out
    table = block_table_TM if block_table_TM.stride(-1) == 1 else block_table_TM.contiguous()
    # TMA reads the cache as one [blocks * page, X] matrix: 16-byte aligned rows, and the rope part's start
    tma = bool(cfg.get("tma")) and cache_NPX.is_contiguous() and cache_NPX.data_ptr() % 16 == 0 and X % 16 == 0
    # one verdict per device and kernel variant (a later specialization could fail where the first one built)
    device_key = (q_THX.device.type, q_THX.device.index, q_THX.dtype, L, R, P, cfg["BLOCK_H"], block_n)
    grid = (T, triton.cdiv(H, cfg["BLOCK_H"]), S)
    launch = {"num_warps": cfg["num_warps"], "num_stages": cfg["num_stages"]}

    def split(use_tma: bool) -> None:
        _launch(_decode_split_kernel, grid, launch)(
            q_THX, cache_NPX, table, kv_lens_T, o_part, lse_part, scale * LOG2E,
            q_THX.stride(0), q_THX.stride(1), cache_NPX.stride(0), cache_NPX.stride(1), table.stride(0),
            o_part.stride(0), o_part.stride(1), o_part.stride(2), lse_part.stride(0), lse_part.stride(1),
            H, triton.cdiv(M, S), cache_NPX.shape[0] * P, X,
            L=L, R=R, PAGE=P, BLOCK_H=cfg["BLOCK_H"], HALF=half, BLOCK_R=block_r, BLOCK_N=block_n,
            IEEE=q_THX.dtype == torch.float32, TMA=use_tma,
        )  # fmt: skip

    done = False
    if cfg.get("ws") and mla_decode_ws.available(q_THX, cache_NPX, L)[0]:
        _ensure_allocator()
        done = _try_variant(("ws", *device_key), lambda: mla_decode_ws.split(
            q_THX, cache_NPX, table, kv_lens_T, o_part, lse_part, scale * LOG2E, S, triton.cdiv(M, S)),
            f"the warp-specialised MLA decode kernel failed on {q_THX.device} ({{reason}}); the Triton kernel runs "
            "instead")  # fmt: skip
    if not done and tma:
        _ensure_allocator()
        done = _try_variant(device_key, lambda: split(True),
                            f"the MLA decode kernel loads through pointers here ({q_THX.device}, latent {L}+{R}, "
                            f"{q_THX.dtype}); its TMA variant failed ({{reason}})")  # fmt: skip
    if not done:
        split(False)
    if S == 1:
        return out
    _decode_reduce_kernel[(T, H)](
        o_part, lse_part, out, o_part.stride(0), o_part.stride(1), o_part.stride(2), lse_part.stride(0),
        lse_part.stride(1), out.stride(0), out.stride(1), L, S,
        BLOCK_S=max(2, triton.next_power_of_2(S)), BLOCK_L=max(16, triton.next_power_of_2(L)), num_warps=4,
    )  # fmt: skip
    return out


def available(example: torch.Tensor) -> tuple[bool, str]:
    """(ok, reason) for the Triton decode kernel on tensors like `example` (q [T, H, L+R])."""
    ok, reason = check.available(example[..., : min(example.shape[-1], check.MAX_HEAD_DIM)])
    if not ok:
        return ok, reason
    if example.dtype == torch.bfloat16 and example.device.type == "cpu":
        return False, "bf16 is not supported by Triton's interpreter"
    reason = reason.replace("kernel", "decode kernel")
    ws, why = mla_decode_ws.device_available(example.device)
    return True, reason + ("; heads in blocks of 64: " + why if ws else "")
