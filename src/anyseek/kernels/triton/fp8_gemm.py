"""The dense FP8 GEMM of FP8 training, with DeepSeek-V3's promotion (twin: `kernels.reference.fp8.gemm`):

    out[M, N] = sum over K-blocks kb of (a[:, kb] @ b[:, kb]^T in fp32) * sa[:, kb] * sb[., kb]

a [M, K] and b [N, K] are E4M3, both K-contiguous (the layout Hopper's FP8 MMA reads); sa [M, KB] holds a's 1x128
tile scales; sb is b's, [N, KB] (1x128 tiles: Wgrad's x^T) or [NB, KB] (128x128 blocks: the weight, in Fprop and
Dgrad). The loop over K is one 128-wide block per iteration: `tl.dot` starts a fresh fp32 accumulator for the block
(on sm_90 Triton lets the tensor cores accumulate FP8 products at their own ~14-bit precision within one dot), and
the block's sum is scaled and added into the outer fp32 accumulator by CUDA cores: the promotion every 128
K-elements is written out, not left to the compiler. Tails (M, N, K not multiples of the tiles) are masked with
zeros, which add nothing.

Shape legend: M rows of a and out, N rows of b (columns of out), K the reduction dim, BM x BN a program's tile.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from anyseek.kernels.triton.launch import launch
from anyseek.kernels.triton.moe_gemm import _tile_of

TILE = 128  # the K-block of the promotion and of the scales (fixed by the recipe)
# 128x128 tiles, 8 warps, 4 stages: DeepGEMM's and FBGEMM's usual shape for 128-blocked FP8 on H100. SCALES_T: a
# K-block's scales side by side ("auto": where b has 1x128 tiles, Wgrad). On an H200 (Triton 3.6, `benchmarks/fp8.py
# --only tune`, stop 47): the promotion as one FMA where b has one scale a tile took the 16B dense down Fprop from 636
# to 873 TFLOP/s; scales side by side took the Wgrad (22528x2048x32768) from 301 to 652, and cost the Fprop 3-12% (so
# not there); operand tiles through tensor descriptors (TMA) ran at 0.9-1.1x of plain loads (not kept); 128x256
# tiles spill (202-437), 256x128 and 64x128 no better.
CONFIG = {"BM": 128, "BN": 128, "GROUP_M": 8, "num_warps": 8, "num_stages": 4, "SCALES_T": "auto"}
INTERPRET_CONFIG = {"BM": 32, "BN": 32, "GROUP_M": 2, "num_warps": 4, "num_stages": 1}


@triton.jit
def block_dot(a, b, SCALED: tl.constexpr):
    """a [BM, BK] @ b [BN, BK]^T, E4M3 in, fp32 out (one K-block: the caller promotes). SCALED: through
    tl.dot_scaled with unit E8M0 scales (127 = 2^0), which on sm_120 is the block-scaled MMA at full rate where a
    plain FP8 mma runs at half (triton-lang/triton#11320); the PTX shows `kind::mxf8f6f4` (benchmarks/fp8.py
    --only compile)."""
    if SCALED:
        one_a = tl.full((a.shape[0], a.shape[1] // 32), 127, tl.uint8)
        one_b = tl.full((b.shape[0], b.shape[1] // 32), 127, tl.uint8)
        return tl.dot_scaled(a, one_a, "e4m3", tl.trans(b), one_b, "e4m3")
    return tl.dot(a, tl.trans(b))


def scaled_dot(device: torch.device) -> bool:
    """Whether the GEMMs use `block_dot`'s SCALED form: on sm_12x (consumer Blackwell) only."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] == 12


@triton.jit
def _gemm_kernel(A, SA, B, SB, C, M, N, K, stride_a, stride_b, stride_c, stride_sa, stride_sb,
                 B_BLOCKS: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                 GROUP_M: tl.constexpr, SCALED: tl.constexpr, SCALES_T: tl.constexpr):  # fmt: skip
    """SCALES_T: SA is [KB, M] and a 1x128 SB [KB, N] (a K-block's scales contiguous: one coalesced load each);
    else [M, KB] and [N, KB] (strided loads). 128x128 blocks' SB is [NB, KB] either way."""
    pid_m, pid_n = _tile_of(tl.program_id(0), tl.cdiv(M, BM), tl.cdiv(N, BN), GROUP_M)  # neighbours share b tiles
    rm = pid_m.to(tl.int64) * BM + tl.arange(0, BM)
    rn = pid_n.to(tl.int64) * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    a_ptr = A + rm[:, None] * stride_a + rk[None, :]
    b_ptr = B + rn[:, None] * stride_b + rk[None, :]
    SB_SCALAR: tl.constexpr = B_BLOCKS and (BN == BK)  # one scale of b a tile and K-block
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for kb in range(tl.cdiv(K, BK)):
        k_ok = rk < K - kb * BK
        a = tl.load(a_ptr, mask=(rm < M)[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(b_ptr, mask=(rn < N)[:, None] & k_ok[None, :], other=0.0)
        block = block_dot(a, b, SCALED)  # this K-block's products, summed by the tensor cores
        if SCALES_T:
            sa = tl.load(SA + kb * stride_sa + rm, mask=rm < M, other=0.0)
        else:
            sa = tl.load(SA + rm * stride_sa + kb, mask=rm < M, other=0.0)
        # the promotion: the block's sum scaled and added in fp32
        if SB_SCALAR:  # one fused multiply-add an element
            acc = tl.fma(block, (sa * tl.load(SB + pid_n * stride_sb + kb))[:, None], acc)
        else:
            if B_BLOCKS:
                sb = tl.load(SB + (rn // BK) * stride_sb + kb, mask=rn < N, other=0.0)
            elif SCALES_T:
                sb = tl.load(SB + kb * stride_sb + rn, mask=rn < N, other=0.0)
            else:
                sb = tl.load(SB + rn * stride_sb + kb, mask=rn < N, other=0.0)
            acc += block * (sa[:, None] * sb[None, :])
        a_ptr += BK
        b_ptr += BK
    c_ptr = C + rm[:, None] * stride_c + rn[None, :]
    tl.store(c_ptr, acc.to(C.dtype.element_ty), mask=(rm < M)[:, None] & (rn < N)[None, :])


def gemm(a_MK: torch.Tensor, sa_MB: torch.Tensor, b_NK: torch.Tensor, sb: torch.Tensor,
         out_dtype: torch.dtype = torch.float32, config: dict | None = None,
         scaled: bool | None = None) -> torch.Tensor:  # fmt: skip
    """a @ b^T -> [M, N] in out_dtype (bf16, fp16 or fp32), from E4M3 a [M, K] and b [N, K] (each K-contiguous),
    a's 1x128 scales sa [M, KB] and b's scales sb: [N, KB] (1x128 tiles) or [NB, KB] (128x128 blocks). scaled:
    `block_dot`'s tl.dot_scaled form (None: where `scaled_dot` says)."""
    M, K = a_MK.shape
    N = b_NK.shape[0]
    KB = triton.cdiv(K, TILE)
    if b_NK.shape[1] != K or a_MK.stride(1) != 1 or b_NK.stride(1) != 1:
        raise ValueError(f"fp8 gemm: a [M, K] and b [N, K], K-contiguous, expected; got a {tuple(a_MK.shape)} "
                         f"(strides {a_MK.stride()}), b {tuple(b_NK.shape)} (strides {b_NK.stride()})")
    if a_MK.dtype != torch.float8_e4m3fn or b_NK.dtype != torch.float8_e4m3fn:
        raise ValueError(f"fp8 gemm: E4M3 operands expected, got {a_MK.dtype} and {b_NK.dtype}")
    blocks = sb.shape == (triton.cdiv(N, TILE), KB) and sb.shape[0] != N  # (N == 1: either reading is the same)
    if sa_MB.shape != (M, KB) or not (blocks or sb.shape == (N, KB)):
        raise ValueError(f"fp8 gemm: scales sa {tuple(sa_MB.shape)} (want ({M}, {KB})) and sb {tuple(sb.shape)} "
                         f"(want ({N}, {KB}) or ({triton.cdiv(N, TILE)}, {KB})) do not fit")
    if a_MK.device.type == "cpu" and out_dtype != torch.float32:  # (the interpreter rounds fp32 to bf16 toward zero,
        return gemm(a_MK, sa_MB, b_NK, sb, torch.float32, config, scaled).to(out_dtype)  # triton 3.9: PyTorch does)
    sa_MB, sb = sa_MB.contiguous(), sb.contiguous()  # (the kernel steps through a row's scales one by one)
    c = torch.empty(M, N, dtype=out_dtype, device=a_MK.device)
    if M == 0 or N == 0:
        return c
    if K == 0:
        return c.zero_()
    cfg = dict(config or (INTERPRET_CONFIG if a_MK.device.type == "cpu" else CONFIG))
    BM, BN, group_m = cfg.pop("BM"), cfg.pop("BN"), cfg.pop("GROUP_M")
    scales_t = cfg.pop("SCALES_T", "auto")
    if scales_t == "auto":  # (measured: see CONFIG)
        scales_t = not blocks
    grid = (triton.cdiv(M, BM) * triton.cdiv(N, BN),)
    # (`launch` lowers num_stages where shared memory is short: 4 stages of 128x128 + 128x128 bytes want 128 KB,
    # consumer GPUs (sm_89, sm_120) have ~100)
    scaled = scaled_dot(a_MK.device) if scaled is None else scaled
    if scales_t:  # a K-block's scales side by side (a small copy: M x KB fp32, 23 MB for 16B's largest Wgrad)
        sa_MB = sa_MB.t().contiguous()
        sb = sb if blocks else sb.t().contiguous()
    launch(_gemm_kernel, grid, cfg)(a_MK, sa_MB, b_NK, sb, c, M, N, K, a_MK.stride(0), b_NK.stride(0), c.stride(0),
                                    sa_MB.stride(0), sb.stride(0), B_BLOCKS=blocks, BM=BM, BN=BN, BK=TILE,
                                    GROUP_M=group_m, SCALED=scaled, SCALES_T=scales_t)  # fmt: skip
    return c
