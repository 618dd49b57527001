"""Triton attention on packed variable-length batches: forward (keeps the log-sum-exp) and backward.

One kernel family serves both public ops. The query/key dim is split in two parts, C = A + B:
part A has a key per head (MLA: k_nope; varlen: k[..., :A]); part B has either a key per head (varlen:
k[..., A:]) or ONE key shared by every head (MLA: k_pe, read through a head stride of 0, never expanded).
The backward sums the shared part's key gradient over heads inside the kernel (fp32 atomics per head group).

Work is scheduled per document: a tile is (document, block of rows) with blocks aligned to the document's
start, so no tile straddles two documents; key loops stop at the causal diagonal and the document end, and
only the diagonal / last block is masked. Tiles are ordered heaviest first (longest key loop) for balance.
The tile list is built on the device with a fixed upper bound on its length: no host sync, graph-safe.

Shape legend: T tokens, H heads, A / B the two query-key parts, Vd value dim, BM / BN row / key block.
"""

from __future__ import annotations

import math
import weakref

import torch
import triton

from anyseek.kernels.triton.attention_bwd import _dkdv_kernel, _dq_kernel
from anyseek.kernels.triton.attention_fwd import _fwd_kernel
from anyseek.kernels.triton.check import interpreting
from anyseek.kernels.triton.launch import launch as _launch

LOG2E = 1.4426950408889634
PROGRAMS_PER_SM = 8  # dk/dv programs per SM when heads are grouped (see _heads_per_program)


# ----------------------------------------------------------------------------------------------------------------
# schedule


# Schedules built per cu_seqlens tensor: every layer of a step (forward and backward) passes the same tensor, so
# the ~20 small torch ops that build a schedule (~0.3 ms of host time, measured on an H200) run once per step.
# An entry is valid while that very tensor object is alive and unmodified (weakref identity + version counter).
_SCHEDULES: dict[tuple, tuple[weakref.ref, int, torch.Tensor]] = {}


def tiles(cu_seqlens: torch.Tensor, T: int, block: int, causal: bool, from_diagonal: bool) -> torch.Tensor:
    """Cached `build_tiles` (see there), by the cu_seqlens tensor itself (alive, unmodified): every layer of a
    forward and its backward share one schedule per kind. Also while a CUDA graph is recorded: the schedule is then
    computed inside the graph, once per replay, from the tensor the model built in that same recording
    (`PackedLayout.build` makes a tensor of its own, never a graph's input buffer, which each replay rewrites)."""
    if torch.compiler.is_compiling():
        return build_tiles(cu_seqlens, T, block, causal, from_diagonal)
    key = (id(cu_seqlens), T, block, causal, from_diagonal)
    hit = _SCHEDULES.get(key)
    if hit is not None and hit[0]() is cu_seqlens and hit[1] == cu_seqlens._version:
        return hit[2]
    sched = build_tiles(cu_seqlens, T, block, causal, from_diagonal)
    if len(_SCHEDULES) > 64:
        _SCHEDULES.clear()
    _SCHEDULES[key] = (weakref.ref(cu_seqlens), cu_seqlens._version, sched)
    return sched


def build_tiles(cu_seqlens: torch.Tensor, T: int, block: int, causal: bool, from_diagonal: bool) -> torch.Tensor:
    """(doc, block start) int32 [2, n_ub], heaviest first; unused slots have doc -1 and sort last.

    from_diagonal=False: work of a row tile = key blocks up to its diagonal (forward, dq).
    from_diagonal=True: work of a key tile = row blocks from its diagonal to the document end (dk, dv)."""
    B = cu_seqlens.numel() - 1
    cu = cu_seqlens.to(torch.int64)
    nblk = (cu[1:] - cu[:-1] + block - 1) // block
    cum = torch.cumsum(nblk, 0)
    n_ub = triton.cdiv(T, block) + B
    i = torch.arange(n_ub, device=cu.device)
    doc = torch.searchsorted(cum, i, right=True).clamp_(max=B - 1)
    blk = i - (cum[doc] - nblk[doc])
    valid = i < cum[-1]
    if causal:
        work = nblk[doc] - blk if from_diagonal else blk + 1
    else:
        work = nblk[doc]
    order = torch.argsort(torch.where(valid, work, -1), descending=True)
    doc, start, valid = doc[order], (cu[doc] + blk * block)[order], valid[order]
    return torch.stack([torch.where(valid, doc, -1), start]).to(torch.int32)


# ----------------------------------------------------------------------------------------------------------------
# launchers


def _pow2(n: int) -> int:
    return max(16, triton.next_power_of_2(n))


def split_dim(D: int) -> tuple[int, int]:
    """Split a head dim into (A, B) with A a power of two: 192 -> (128, 64), 256 -> (256, 0), 80 -> (64, 16)."""
    if D <= 16 or D & (D - 1) == 0:
        return D, 0
    A = 1 << (D.bit_length() - 1)
    return A, D - A


def _config(kind: str, A: int, B: int, VD: int, device: torch.device, max_seqlen: int) -> dict:
    """Block sizes and launch settings per kernel (kind: fwd, dkdv, dq).

    On the interpreter: 16x16 tiles (small and quick). On GPUs: from sweeps on an H200 (benchmarks/attention.py
    --tune, docs/benchmarks.md) for DeepSeek-V3's 128+64 / 128 dims. Short documents (max_seqlen <= 512,
    e.g. packed Wikipedia leads) waste less of a small tile; dims wider than 384 in all get smaller tiles."""
    if device.type != "cuda":
        return {"BLOCK_M": 16, "BLOCK_N": 16, "num_warps": 1, "num_stages": 1}
    wide = _pow2(A) + (_pow2(B) if B else 0) + _pow2(VD) > 384
    short = max_seqlen <= 512
    table = {
        ("fwd", False, False): (128, 64, 8, 4),
        ("fwd", True, False): (64, 32, 4, 2),
        ("fwd", False, True): (64, 64, 8, 2),
        ("fwd", True, True): (64, 64, 8, 2),
        ("dkdv", False, False): (32, 128, 8, 3),
        ("dkdv", True, False): (32, 32, 4, 2),
        ("dkdv", False, True): (32, 64, 8, 1),
        ("dkdv", True, True): (32, 64, 8, 1),
        ("dq", False, False): (128, 64, 8, 3),
        ("dq", True, False): (64, 32, 4, 2),
        ("dq", False, True): (64, 32, 8, 2),
        ("dq", True, True): (64, 32, 8, 2),
    }
    bm, bn, w, st = table[(kind, short, wide)]
    return {"BLOCK_M": bm, "BLOCK_N": bn, "num_warps": w, "num_stages": st}


def _prec(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"


def _check(q, ka, kb, v, cu_seqlens, b_shared):
    kb = ka if kb is None else kb
    _T, _H, C = q.shape
    A = ka.shape[-1]
    for name, t in (("q", q), ("k", ka), ("k_b", kb), ("v", v)):
        if t.stride(-1) != 1:
            raise ValueError(f"triton attention needs {name}'s last dim contiguous, got strides {t.stride()}")
        if t.dtype != q.dtype:
            raise ValueError(f"triton attention needs one dtype, got q {q.dtype} and {name} {t.dtype}")
    if b_shared and kb.dim() != 2:
        raise ValueError(f"the shared key part must be [T, R], got {tuple(kb.shape)}")
    if A + (kb.shape[-1] if kb is not ka else 0) != C:
        raise ValueError(f"key dims {A} + {kb.shape[-1]} do not add up to q's head dim {C}")


def _big(*tensors: torch.Tensor) -> bool:
    """Does any element offset reach 2**31 (then the kernels index rows in 64 bits)?"""
    span = max(sum((n - 1) * st for n, st in zip(t.shape, t.stride())) + 1 for t in tensors if t.numel())
    return span >= 2**31 or tensors[0].shape[0] * tensors[0].shape[1] >= 2**31


def _kb_strides(kb: torch.Tensor, b_shared: bool) -> tuple[int, int]:
    return (kb.stride(0), 0) if b_shared else (kb.stride(0), kb.stride(1))


def attention_fwd(q, ka, kb, v, cu_seqlens, max_seqlen, softmax_scale, causal, b_shared):
    """q [T, H, A+B], ka [T, H, A], kb [T, R] (b_shared) or [T, H, B] or None (no B part), v [T, H, Vd].
    Returns out [T, H, Vd] in q's dtype and lse [H, T] fp32 (log2 domain of the scaled scores)."""
    _check(q, ka, kb, v, cu_seqlens, b_shared)
    if not softmax_scale > 0:
        raise ValueError(f"softmax_scale must be positive, got {softmax_scale}")
    T, H, _C = q.shape
    A, VD = ka.shape[-1], v.shape[-1]
    has_b = kb is not None
    B = kb.shape[-1] if has_b else 0
    kb = kb if has_b else ka
    out = torch.empty(T, H, VD, device=q.device, dtype=q.dtype)
    lse = torch.empty(H, T, device=q.device, dtype=torch.float32)
    if T == 0:
        return out, lse
    cfg = _config("fwd", A, B, VD, q.device, max_seqlen)
    sched = tiles(cu_seqlens, T, cfg["BLOCK_M"], causal, from_diagonal=False)
    s_kbt, s_kbh = _kb_strides(kb, b_shared)
    grid = (H, sched.shape[1])
    _launch(_fwd_kernel, grid, cfg)(
        q, ka, kb, v, out, lse, cu_seqlens, sched, sched.shape[1], T, softmax_scale * LOG2E,
        q.stride(0), q.stride(1), ka.stride(0), ka.stride(1), s_kbt, s_kbh, v.stride(0), v.stride(1),
        out.stride(0), out.stride(1),
        A=A, B=max(B, 1), VD=VD, HAS_B=has_b, BA=_pow2(A), BB=_pow2(B), BV=_pow2(VD), CAUSAL=causal,
        PREC=_prec(q.dtype), BIG=_big(q, ka, kb, v, out),
    )  # fmt: skip
    return out, lse


def _heads_per_program(H: int, n_tiles: int, device: torch.device) -> int:
    """Heads one dk/dv program walks through (summing the shared key part's gradient in registers): as many as
    keep >= 4 programs per SM, so that atomics stay few without starving the GPU. A divisor of H."""
    if device.type != "cuda":
        return 1 if H == 1 else 2 if H % 2 == 0 else 1
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    target = max(1, (H * n_tiles) // (PROGRAMS_PER_SM * sms))
    return max(d for d in range(1, H + 1) if H % d == 0 and d <= target)


def attention_bwd(do, q, ka, kb, v, out, lse, cu_seqlens, max_seqlen, softmax_scale, causal, b_shared):
    """Gradients. b_shared (v in q's dtype): (dq [T, H, A+B], d[ka | v] [T, H, A+Vd] in one buffer, dkb [T, R]
    summed over heads) -- MLA splits k_nope and v off one projection, whose gradient this buffer is;
    otherwise (dq, dk [T, H, A+B] for the whole key, None, dv)."""
    T, H, C = q.shape
    A, VD = ka.shape[-1], v.shape[-1]
    has_b = kb is not None
    B = kb.shape[-1] if has_b else 0
    kb = kb if has_b else ka
    do = do.contiguous() if do.stride(-1) != 1 else do
    dq = torch.empty(T, H, C, device=q.device, dtype=q.dtype)
    if b_shared:  # dka and dv: the two halves of one [T, H, A + Vd] buffer, returned whole
        dkv = torch.empty(T, H, A + VD, device=q.device, dtype=q.dtype)
        dka, dv = dkv[..., :A], dkv[..., A:]
        dkb32 = torch.zeros(T, B, device=q.device, dtype=torch.float32)
        dkb_arg = dkb32
    else:
        dv = torch.empty(T, H, VD, device=q.device, dtype=v.dtype)
        dk = torch.empty(T, H, C, device=q.device, dtype=q.dtype)
        dka, dkb_arg = dk[..., :A], (dk[..., A:] if has_b else dk)
    if T == 0:
        return (dq, dkv, dkb32.to(q.dtype)) if b_shared else (dq, dk, None, dv)
    delta = torch.empty(H, T, device=q.device, dtype=torch.float32)  # written by the dq kernel
    qk_scale = softmax_scale * LOG2E
    common = {
        "A": A,
        "B": max(B, 1),
        "VD": VD,
        "HAS_B": has_b,
        "BA": _pow2(A),
        "BB": _pow2(B),
        "BV": _pow2(VD),
        "CAUSAL": causal,
    }
    common["PREC"] = _prec(q.dtype)
    common["BIG"] = _big(q, ka, kb, v, out, do, dq, dv, dka, dkb_arg)
    s_kbt, s_kbh = _kb_strides(kb, b_shared)

    cfg = _config("dq", A, B, VD, q.device, max_seqlen)
    sched = tiles(cu_seqlens, T, cfg["BLOCK_M"], causal, from_diagonal=False)
    _launch(_dq_kernel, (H, sched.shape[1]), cfg)(
        q, ka, kb, v, do, out, lse, delta, dq, cu_seqlens, sched, sched.shape[1], T, qk_scale, softmax_scale,
        q.stride(0), q.stride(1), ka.stride(0), ka.stride(1), s_kbt, s_kbh, v.stride(0), v.stride(1),
        do.stride(0), do.stride(1), out.stride(0), out.stride(1), dq.stride(0), dq.stride(1), **common,
    )  # fmt: skip

    cfg = _config("dkdv", A, B, VD, q.device, max_seqlen)
    sched = tiles(cu_seqlens, T, cfg["BLOCK_N"], causal, from_diagonal=True)
    heads = _heads_per_program(H, sched.shape[1], q.device) if b_shared else 1
    s_dkbt, s_dkbh = (dkb_arg.stride(0), 0) if b_shared else (dkb_arg.stride(0), dkb_arg.stride(1))
    _launch(_dkdv_kernel, (H // heads, sched.shape[1]), cfg)(
        q, ka, kb, v, do, lse, delta, dka, dkb_arg, dv, cu_seqlens, sched, sched.shape[1], T, qk_scale, softmax_scale,
        q.stride(0), q.stride(1), ka.stride(0), ka.stride(1), s_kbt, s_kbh, v.stride(0), v.stride(1),
        do.stride(0), do.stride(1), dka.stride(0), dka.stride(1), s_dkbt, s_dkbh, dv.stride(0), dv.stride(1),
        B_SHARED=b_shared, HEADS=heads, **common,
    )  # fmt: skip
    if b_shared:
        return dq, dkv, dkb32.to(q.dtype)
    return dq, dk, None, dv


def default_scale(C: int, softmax_scale: float | None) -> float:
    return softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(C)


__all__ = ["attention_bwd", "attention_fwd", "default_scale", "interpreting", "split_dim", "tiles"]
