"""AdamW over flat buffers in one Triton kernel, AdamW over lists of tensors in one launch, and the squared norm of a
flat gradient.

`train.working_copy` keeps the trained weights in one flat fp32 buffer (the master weights), their bf16 working copy,
their gradients and both moments in flat buffers of their own (train/precision.py). torch's fused AdamW needs
gradients in the parameters' dtype and writes no working copy, so the step around it was: cast the bf16 gradients
to fp32, the multi-tensor AdamW kernel, cast the weights back to bf16 (40 bytes moved per weight, in ~2 x 150 casts
of which the dtype-converting ones run at half the bandwidth). Here one pass reads the gradient (2 bytes), weight
and moments (12) and writes them (12) and the working copy (2): 28 bytes per weight.

`adamw_tensors` is the same update (fp32 moments, no working copy) for weights that are not one buffer: FSDP2's
DTensor shards, LoRA's adapters (`train.optim.TensorAdamW`). Each program takes BLOCK elements of one tensor; it
finds the tensor's weights, gradient, moments and step count through a table of their addresses (int64, cast to
pointers in the kernel) and its chunk through a table made once per set of sizes. torch's fused AdamW over the same
fp32 tensors runs its multi-tensor launches at about two thirds of the bandwidth (docs/benchmarks.md).

The maths is `kernels.reference.adamw`'s (torch.optim.AdamW's update). Offsets are int64 (flat buffers of large
models pass 2**31 elements).

bf16 moments (`train.moments_dtype=bf16`, DeepSeek-V3's low-precision optimizer states): m and v are read as bf16,
updated in fp32 and stored with stochastic rounding (20 bytes per weight instead of 28). The kernel sees them as
int16 bit patterns (so the Triton interpreter, whose bf16 is broken, runs it too): a bf16 is the high half of an
fp32, and adding a uniform random 16-bit number to the fp32's bits before dropping the low half rounds up with
probability equal to the dropped fraction, so the rounding is unbiased (round-to-nearest loses every update below
half a bf16 ulp, 2^-9 of the value: most of v's with beta2 >= 0.998). The random numbers are a hash of (seed,
element): deterministic, so a resumed run rounds as the uninterrupted one did.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

BLOCK = 2048  # elements per program: 8 per thread at 8 warps (16-byte fp32 loads), and few programs in flight


@triton.jit
def _hash32(x):
    """A 32-bit integer hash (uint32 in, uint32 out; good avalanche, ~8 integer ops)."""
    x ^= x >> 16
    x *= 0x7FEB352D
    x ^= x >> 15
    x *= 0x846CA68B
    x ^= x >> 16
    return x


@triton.jit
def _from_bf16_bits(b):
    """int16 bit patterns of bf16 values -> fp32."""
    return (b.to(tl.uint16, bitcast=True).to(tl.uint32) << 16).to(tl.float32, bitcast=True)


@triton.jit
def _to_bf16_bits(x, r):
    """fp32 -> int16 bit patterns of bf16, rounded stochastically with the uniform 16-bit numbers r (uint32 < 2^16);
    a NaN stays a NaN."""
    bits = x.to(tl.uint32, bitcast=True)
    hi = ((bits + r) >> 16) & 0xFFFF
    hi = tl.where(x != x, 0x7FC0, hi)
    return hi.to(tl.uint16).to(tl.int16, bitcast=True)


@triton.jit(do_not_specialize=["seed"])
def _adamw_kernel(P, G, M, V, LOW, SCALE, SKIP, n, lr, beta1, beta2, eps, decay, step_size, bc2_sqrt, seed,
                  HAS_LOW: tl.constexpr, HAS_SKIP: tl.constexpr, BF16_MOMENTS: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    if HAS_SKIP:  # a step skipped on the device: every load and store masked off (nothing read, nothing written)
        n = tl.where(tl.load(SKIP) == 0, n, 0)
    mask = offs < n
    g = tl.load(G + offs, mask=mask, other=0.0).to(tl.float32) / tl.load(SCALE)
    p = tl.load(P + offs, mask=mask, other=0.0)
    if BF16_MOMENTS:
        m = _from_bf16_bits(tl.load(M + offs, mask=mask, other=0))
        v = _from_bf16_bits(tl.load(V + offs, mask=mask, other=0))
    else:
        m = tl.load(M + offs, mask=mask, other=0.0)
        v = tl.load(V + offs, mask=mask, other=0.0)
    p = p * (1.0 - decay)
    m = m + (1.0 - beta1) * (g - m)  # lerp, as torch's
    v = beta2 * v + (1.0 - beta2) * g * g
    if BF16_MOMENTS:  # (this step's update uses them unrounded)
        r = _hash32((offs & 0xFFFFFFFF).to(tl.uint32) ^ _hash32(seed.to(tl.uint32)))
        tl.store(M + offs, _to_bf16_bits(m, r & 0xFFFF), mask=mask)
        tl.store(V + offs, _to_bf16_bits(v, r >> 16), mask=mask)
    else:
        tl.store(M + offs, m, mask=mask)
        tl.store(V + offs, v, mask=mask)
    p = p - step_size * (m / (tl.sqrt(v) / bc2_sqrt + eps))
    tl.store(P + offs, p, mask=mask)
    if HAS_LOW:
        tl.store(LOW + offs, p.to(LOW.dtype.element_ty), mask=mask)


@triton.jit
def _adamw_tensors_kernel(PTRS, CHUNK_T, CHUNK_START, NUMEL, NT, SCALE, SKIP, lr, beta1, beta2, eps, decay,
                          log2_beta1, log2_beta2, HAS_SKIP: tl.constexpr, G_KIND: tl.constexpr, LOW_KIND: tl.constexpr,
                          ALIGNED: tl.constexpr, BLOCK: tl.constexpr):
    """Program c: BLOCK elements of tensor CHUNK_T[c] from CHUNK_START[c]. PTRS [5 or 6, NT] int64: the addresses of
    each tensor's weights (fp32), gradient (G_KIND 0 fp32, 1 bf16, 2 fp16), exp_avg, exp_avg_sq (fp32), step (fp32
    scalar, already counted for this update) and, where LOW_KIND is not 0, its low-precision copy written from the
    new weights (LOW_KIND 1 bf16, 2 fp16). ALIGNED: every address is a multiple of 16 bytes and every size of 16
    elements (the host checked), so the loads and stores can be vectorized (addresses and sizes read from a table
    carry no alignment the compiler can see; without it each element was its own load)."""
    c = tl.program_id(0)
    t = tl.load(CHUNK_T + c)
    start = tl.load(CHUNK_START + c)
    if ALIGNED:
        start = tl.multiple_of(start, BLOCK)
    offs = start + tl.arange(0, BLOCK)
    n = tl.load(NUMEL + t)
    if HAS_SKIP:  # a step skipped on the device: nothing read, nothing written
        n = tl.where(tl.load(SKIP) == 0, n, 0)
    if ALIGNED:
        n = tl.multiple_of(n, 16)
    mask = offs < n
    P = tl.load(PTRS + t).to(tl.pointer_type(tl.float32))
    if G_KIND == 1:
        G = tl.load(PTRS + NT + t).to(tl.pointer_type(tl.bfloat16))
    elif G_KIND == 2:
        G = tl.load(PTRS + NT + t).to(tl.pointer_type(tl.float16))
    else:
        G = tl.load(PTRS + NT + t).to(tl.pointer_type(tl.float32))
    M = tl.load(PTRS + 2 * NT + t).to(tl.pointer_type(tl.float32))
    V = tl.load(PTRS + 3 * NT + t).to(tl.pointer_type(tl.float32))
    if ALIGNED:
        P, G, M, V = tl.multiple_of(P, 16), tl.multiple_of(G, 16), tl.multiple_of(M, 16), tl.multiple_of(V, 16)
    step = tl.load(tl.load(PTRS + 4 * NT + t).to(tl.pointer_type(tl.float32)))
    step_size = lr / (1.0 - tl.exp2(step * log2_beta1))
    bc2_sqrt = tl.sqrt(1.0 - tl.exp2(step * log2_beta2))
    g = tl.load(G + offs, mask=mask, other=0.0).to(tl.float32) / tl.load(SCALE)
    p = tl.load(P + offs, mask=mask, other=0.0)
    m = tl.load(M + offs, mask=mask, other=0.0)
    v = tl.load(V + offs, mask=mask, other=0.0)
    p = p * (1.0 - decay)
    m = m + (1.0 - beta1) * (g - m)
    v = beta2 * v + (1.0 - beta2) * g * g
    tl.store(M + offs, m, mask=mask)
    tl.store(V + offs, v, mask=mask)
    p = p - step_size * (m / (tl.sqrt(v) / bc2_sqrt + eps))
    tl.store(P + offs, p, mask=mask)
    if LOW_KIND == 1:
        LOW = tl.load(PTRS + 5 * NT + t).to(tl.pointer_type(tl.bfloat16))
        if ALIGNED:
            LOW = tl.multiple_of(LOW, 16)
        tl.store(LOW + offs, p.to(tl.bfloat16), mask=mask)
    elif LOW_KIND == 2:
        LOW = tl.load(PTRS + 5 * NT + t).to(tl.pointer_type(tl.float16))
        if ALIGNED:
            LOW = tl.multiple_of(LOW, 16)
        tl.store(LOW + offs, p.to(tl.float16), mask=mask)


@triton.jit
def _sq_norm_kernel(X, OUT, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(X + offs, mask=offs < n, other=0.0).to(tl.float32)
    tl.store(OUT + tl.program_id(0), tl.sum(x * x, axis=0))


@torch.no_grad()
def adamw_flat(p, grad, m, v, low, scale, step, lr, beta1, beta2, eps, weight_decay, skip=None, seed=0) -> None:
    """As `kernels.reference.adamw.adamw_flat`."""
    n = p.numel()
    if n == 0:
        return
    bf16 = m.dtype == torch.bfloat16
    mm, vv = (m.view(torch.int16), v.view(torch.int16)) if bf16 else (m, v)
    _adamw_kernel[(triton.cdiv(n, BLOCK),)](
        p, grad, mm, vv, low if low is not None else p, scale, skip if skip is not None else scale, n, lr, beta1,
        beta2, eps, lr * weight_decay, lr / (1.0 - beta1**step), math.sqrt(1.0 - beta2**step), seed & 0x7FFFFFFF,
        HAS_LOW=low is not None, HAS_SKIP=skip is not None, BF16_MOMENTS=bf16, BLOCK=BLOCK, num_warps=8,
    )  # fmt: skip


_G_KINDS = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
TENSORS_BLOCK, TENSORS_WARPS = BLOCK, 16  # elements per program, warps: the best of 2048-8192 x 4-16 on an H100
_CHUNKS: dict[tuple, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}  # by (device, block, numels)
_POINTERS: dict[tuple, torch.Tensor] = {}  # the last few launches' address tables, by the addresses


def _to(device: torch.device, t: torch.Tensor) -> torch.Tensor:
    return (t.pin_memory() if device.type == "cuda" else t).to(device, non_blocking=True)


def _chunk_tables(numel: tuple[int, ...], device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(tensor id per chunk int32, chunk start int64, numel per tensor int64) on `device`: made once per set of
    sizes (a model's 2.8 MB of them for `small`'s 486M weights)."""
    key = (device, TENSORS_BLOCK, numel)
    hit = _CHUNKS.get(key)
    if hit is None:
        if len(_CHUNKS) >= 8:  # (a process that builds many models: tests)
            _CHUNKS.pop(next(iter(_CHUNKS)))
        chunks = [triton.cdiv(k, TENSORS_BLOCK) for k in numel]
        ids = torch.repeat_interleave(torch.arange(len(numel), dtype=torch.int32), torch.tensor(chunks))
        first = torch.tensor([0] + chunks[:-1]).cumsum(0)
        starts = (torch.arange(ids.numel(), dtype=torch.int64) - first[ids.long()]) * TENSORS_BLOCK
        hit = _CHUNKS[key] = (_to(device, ids), _to(device, starts), _to(device, torch.tensor(numel)))
    return hit


def _pointer_table(lists, device) -> tuple[torch.Tensor, bool]:
    """(PTRS [len(lists), NT] int64 on `device`, whether every address but the steps' is a multiple of 16 bytes and
    every size a multiple of 16 elements):
    the lists' addresses, kept while they stay the same (the weights, moments, steps and low copies always do;
    gradients do when the step is graphed or their buffers are reused)."""
    ptrs = tuple(t.data_ptr() for ts in lists for t in ts)
    hit = _POINTERS.get((device, ptrs))
    if hit is None:
        if len(_POINTERS) >= 4:
            _POINTERS.pop(next(iter(_POINTERS)))
        aligned = all(t.data_ptr() % 16 == 0 for i, ts in enumerate(lists) if i != 4 for t in ts) and all(
            t.numel() % 16 == 0 for t in lists[0])
        hit = _POINTERS[(device, ptrs)] = (_to(device, torch.tensor(ptrs, dtype=torch.int64)), aligned)
    return hit


@torch.no_grad()
def adamw_tensors(params, grads, exp_avgs, exp_avg_sqs, steps, scale, lr, beta1, beta2, eps, weight_decay,
                  skip=None, lows=None) -> None:
    """As `kernels.reference.adamw.adamw_tensors`: one launch for every tensor of the lists."""
    if not params:
        return
    device = params[0].device
    ids, starts, numel = _chunk_tables(tuple(p.numel() for p in params), device)
    if ids.numel() == 0:
        return
    lists = (params, grads, exp_avgs, exp_avg_sqs, steps) + (() if lows is None else (lows,))
    ptrs, aligned = _pointer_table(lists, device)
    _adamw_tensors_kernel[(ids.numel(),)](
        ptrs, ids, starts, numel, len(params), scale, skip if skip is not None else scale, lr, beta1, beta2, eps,
        lr * weight_decay, math.log2(beta1), math.log2(beta2), HAS_SKIP=skip is not None,
        G_KIND=_G_KINDS[grads[0].dtype], LOW_KIND=0 if lows is None else _G_KINDS[lows[0].dtype],
        ALIGNED=aligned, BLOCK=TENSORS_BLOCK, num_warps=TENSORS_WARPS,
    )  # fmt: skip


def sq_norm(x: torch.Tensor) -> torch.Tensor:
    """As `kernels.reference.adamw.sq_norm`: per-program partial sums in fp32, then one sum."""
    n = x.numel()
    partial = torch.empty(max(1, triton.cdiv(n, BLOCK)), dtype=torch.float32, device=x.device)
    if n == 0:
        return partial.zero_().sum()
    _sq_norm_kernel[(partial.numel(),)](x, partial, n, BLOCK=BLOCK, num_warps=8)
    return partial.sum()


def available(example: torch.Tensor) -> tuple[bool, str]:
    from anyseek.kernels.triton.check import available as triton_available

    return triton_available(example[..., :1])
