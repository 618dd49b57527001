"""Pure-PyTorch twin of FP8 training's linear layers, DeepSeek-V3's recipe (arXiv 2412.19437 §3.3):

- every FP8 tensor is E4M3 (torch.float8_e4m3fn, largest finite 448), scaled by fp32 scales taken from the current
  tensor (amax / 448 per tile, no delayed scaling); a tile whose values are all zero gets scale 1;
- activations and gradients are quantized per 1x128 tile (one row, 128 consecutive elements along the reduction
  dim; the last tile of a row may be shorter), weights per 128x128 block;
- the routed experts' input has power-of-two scales (the paper's for the activations expert parallelism sends:
  `pack_rows` / `unpack_rows`), so that the rows an expert receives quantize to what they were sent as;
- an FP8 GEMM sums each 128-wide K-block of products in fp32 and applies the two operands' scales there, adding
  the scaled block into an fp32 accumulator (the "promotion every 128 K-elements" that makes up for the tensor
  cores' ~14-bit FP8 accumulation);
- the linear layer y = x W^T runs three such GEMMs: Fprop (x 1x128 tiles, W 128x128 blocks), Dgrad
  (dy 1x128 tiles along the output features, W's blocks used transposed) and Wgrad (dy^T and x^T, both in 1x128
  tiles along the tokens, i.e. 128x1 tiles of dy and x; fp32 out). Wgrad's x comes from the FP8 copy the forward
  kept: dequantized and quantized again along the tokens (`requantize_t`).

Every GEMM here is `gemm(a, sa, b, sb)` = a @ b^T with both operands K-contiguous ([M, K] and [N, K]), the layout the
Triton kernel (`kernels/triton/fp8_gemm.py`) reads; sa [M, KB] per row, sb [N, KB] per row or [NB, KB] per block.
`grouped_gemm` is the routed experts' GEMM (per-expert weights, rows gathered from the tokens), the twin of
`kernels/triton/fp8_grouped.py`. `accumulate_limited` emulates the tensor cores' limited accumulator, for the test
that shows why promotion matters, and `gemm_emulated` the promoted GEMM on such tensor cores, the yardstick of a GPU
kernel's fp32 output.

Shape legend: M rows (tokens), K the reduction dim, N output features, KB / MB / NB their counts of 128-blocks.
"""

from __future__ import annotations

import torch

E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0
TILE = 128


def _scale(amax: torch.Tensor) -> torch.Tensor:
    """amax / 448 in fp32, rounded to nearest; 1 where the tile is all zeros (its values quantize to 0 whatever the
    scale). Divided by a tensor: PyTorch's CUDA division by a Python number multiplies by its reciprocal, which
    rounds differently in about half the tiles (1 ulp; stop 46, H200), and then ~0.1% of the codes differ from the
    Triton kernels' (`div_rn`) and from this twin on a CPU."""
    amax = amax.float()
    return torch.where(amax > 0, amax / torch.full_like(amax, E4M3_MAX), torch.ones_like(amax))


def _pad_to(x: torch.Tensor, dim: int) -> torch.Tensor:
    """x with zeros appended along `dim` up to a multiple of TILE (zeros change no amax)."""
    extra = -x.shape[dim] % TILE
    if not extra:
        return x
    pad = [0, 0] * (x.dim() - 1 - dim % x.dim()) + [0, extra]
    return torch.nn.functional.pad(x, pad)


def pow2_up(s: torch.Tensor) -> torch.Tensor:
    """The least power of two >= s (fp32, s > 0), from its bits: the exponent raised by one unless the mantissa is
    zero (an exact power of two stays)."""
    return ((s.view(torch.int32) + 0x7FFFFF) & -0x800000).view(torch.float32)


def quantize_rows(x_MK: torch.Tensor, pow2: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """1x128 tiles: x [M, K] (any float dtype) -> (q [M, K] E4M3, scales [M, KB] fp32), x ~ q * scale. pow2: each
    scale rounded up to a power of two (`pow2_up`; the paper's scales for the rows expert parallelism sends), so
    that q * scale is exact in bf16 and quantizing those values again gives them back."""
    M, K = x_MK.shape
    xp = _pad_to(x_MK.float(), 1).view(M, -1, TILE)
    s_MB = _scale(xp.abs().amax(dim=-1))
    if pow2:
        s_MB = pow2_up(s_MB)
    q = (xp / s_MB[..., None]).to(E4M3).view(M, -1)[:, :K]
    return q, s_MB


def quantize_rows_t(x_MK: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x^T in 1x128 tiles along M (128x1 tiles of x): x [M, K] -> (q [K, M] E4M3, scales [K, MB] fp32)."""
    return quantize_rows(x_MK.t())


def quantize_both(x_MK: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(`quantize_rows`, `quantize_rows_t`) of x -> (q [M, K], scales [M, KB], q^T [K, M], scales [K, MB]) (the
    Triton kernel reads x once for both)."""
    return (*quantize_rows(x_MK), *quantize_rows_t(x_MK))


def quantize_blocks(w_NK: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """128x128 blocks: w [N, K] -> (q [N, K] E4M3, scales [NB, KB] fp32). The same scales serve w^T (transposed)."""
    N, K = w_NK.shape
    wp = _pad_to(_pad_to(w_NK.float(), 0), 1)
    NB, KB = wp.shape[0] // TILE, wp.shape[1] // TILE
    blocks = wp.view(NB, TILE, KB, TILE)
    s_NBKB = _scale(blocks.abs().amax(dim=(1, 3)))
    q = (blocks / s_NBKB[:, None, :, None]).to(E4M3).view(NB * TILE, KB * TILE)[:N, :K]
    return q, s_NBKB


def dequantize_rows(q_MK: torch.Tensor, s_MB: torch.Tensor) -> torch.Tensor:
    """The fp32 values q * scale of a 1x128-tiled tensor (exact: an E4M3 value times an fp32 scale)."""
    return q_MK.float() * s_MB.repeat_interleave(TILE, dim=1)[:, :q_MK.shape[1]]


def pack_rows(x_MK: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows as expert parallelism sends them: x [M, K] -> (E4M3 codes as bytes [M, K] uint8, power-of-two 1x128
    scales [M, KB] fp32); `unpack_rows` gives back the quantized values exactly."""
    q, s = quantize_rows(x_MK, pow2=True)
    return q.contiguous().view(torch.uint8), s


def unpack_rows(q_MK: torch.Tensor, s_MB: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`pack_rows`' codes and scales -> the values q * scale in `dtype` (exact in bf16 and fp32: an E4M3 value times a
    power of two)."""
    return dequantize_rows(q_MK.view(E4M3), s_MB).to(dtype)


def dequantize_blocks(q_NK: torch.Tensor, s_NBKB: torch.Tensor) -> torch.Tensor:
    """The fp32 values of a 128x128-blocked tensor."""
    N, K = q_NK.shape
    s = s_NBKB.repeat_interleave(TILE, dim=0).repeat_interleave(TILE, dim=1)[:N, :K]
    return q_NK.float() * s


def requantize_t(q_MK: torch.Tensor, s_MB: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Wgrad's re-tiling: a 1x128-tiled x (q [M, K], scales [M, KB]) -> x^T in 1x128 tiles along M (q [K, M],
    scales [K, MB]), from the dequantized values."""
    return quantize_rows_t(dequantize_rows(q_MK, s_MB))


def _b_scales(sb: torch.Tensor, N: int) -> torch.Tensor:
    """b's scales per row [N, KB]: as given (1x128 tiles) or each block's scale repeated over its 128 rows."""
    return sb if sb.shape[0] == N else sb.repeat_interleave(TILE, dim=0)[:N]


def gemm(a_MK: torch.Tensor, sa_MB: torch.Tensor, b_NK: torch.Tensor, sb: torch.Tensor,
         out_dtype: torch.dtype = torch.float32) -> torch.Tensor:  # fmt: skip
    """a @ b^T from E4M3 operands: a [M, K] with scales [M, KB] (1x128 tiles), b [N, K] with scales [N, KB] (1x128
    tiles) or [NB, KB] (128x128 blocks) -> [M, N] in out_dtype. Each K-block's products are summed in fp32 (exact
    products: E4M3 has 4 significant bits), scaled by sa and sb there and added into the fp32 result."""
    M, K = a_MK.shape
    N = b_NK.shape[0]
    sb_NB = _b_scales(sb, N)
    out = torch.zeros(M, N, dtype=torch.float32, device=a_MK.device)
    for kb, k0 in enumerate(range(0, K, TILE)):
        part = a_MK[:, k0:k0 + TILE].float() @ b_NK[:, k0:k0 + TILE].float().t()
        out += part * sa_MB[:, kb, None] * sb_NB[None, :, kb]
    return out.to(out_dtype)


def accumulate_limited(a_MK: torch.Tensor, b_NK: torch.Tensor, promote_every: int | None, chunk: int = 32,
                       bits: int = 14) -> torch.Tensor:  # fmt: skip
    """An emulation of the tensor cores' FP8 accumulator, for unscaled E4M3 operands a [M, K], b [N, K] -> fp64
    [M, N]. What is emulated: the products are exact and reach the accumulator `chunk` at a time (one Hopper FP8
    WGMMA reduces 32 K-elements); the accumulator keeps `bits` significant bits (FP22's 13 stored mantissa bits + 1;
    DeepSeek-V3 measures ~14): within a chunk every product is aligned to the largest exponent among them and the
    accumulator and cut there toward zero, and the new sum is cut to `bits` bits again. promote_every=None: that
    accumulator runs over all of K (an FP8 GEMM without promotion); an int (128): it restarts every promote_every
    K-elements and each partial sum is added into an fp64 accumulator (the promotion, fp32 on the GPU)."""
    prods = a_MK.double()[:, None, :] * b_NK.double()[None, :, :]  # [M, N, K]
    K = prods.shape[-1]
    span = promote_every or K
    total = torch.zeros(prods.shape[:2], dtype=torch.float64, device=a_MK.device)
    for p0 in range(0, K, span):
        acc = torch.zeros_like(total)
        for c0 in range(p0, min(p0 + span, K), chunk):
            part = prods[..., c0:min(c0 + chunk, p0 + span)]
            top = torch.maximum(acc.abs(), part.abs().amax(-1))
            # one unit of the last bit the accumulator keeps, at the largest magnitude in play
            quantum = torch.ldexp(torch.ones_like(top), torch.frexp(top)[1] - bits)[..., None]
            acc = _truncate(acc + (torch.trunc(part / quantum) * quantum).sum(-1), bits)
        total += acc
    return total


def gemm_emulated(a_MK: torch.Tensor, sa_MB: torch.Tensor, b_NK: torch.Tensor, sb: torch.Tensor) -> torch.Tensor:
    """`gemm` as FP8 tensor cores with the promotion compute it, in fp64 [M, N]: each K-block's products summed by
    the limited accumulator of `accumulate_limited`, then scaled and added exactly. The yardstick for a GPU kernel's
    fp32 output, whose K-blocks the hardware sums at ~14 bits (PyTorch's fp32 matmul is far more exact than any FP8
    tensor core). Memory: M * N * 128 fp64 products at a time."""
    M, K = a_MK.shape
    sb_NB = _b_scales(sb, b_NK.shape[0]).double()
    out = torch.zeros(M, b_NK.shape[0], dtype=torch.float64, device=a_MK.device)
    for kb, k0 in enumerate(range(0, K, TILE)):
        part = accumulate_limited(a_MK[:, k0:k0 + TILE], b_NK[:, k0:k0 + TILE], None)
        out += part * sa_MB[:, kb, None].double() * sb_NB[None, :, kb]
    return out


def _truncate(x: torch.Tensor, bits: int) -> torch.Tensor:
    """x with its significand cut to `bits` bits, toward zero."""
    m, e = torch.frexp(x)  # x = m * 2^e, 0.5 <= |m| < 1
    return torch.ldexp(torch.trunc(torch.ldexp(m, torch.full_like(e, bits))), e - bits)


def linear_forward(x_MK: torch.Tensor, w_NK: torch.Tensor, out_dtype: torch.dtype):
    """Fprop: y = x W^T -> (y [M, N] in out_dtype, what backward needs: (q_x, s_x, q_w, s_w))."""
    q_x, s_x = quantize_rows(x_MK)
    q_w, s_w = quantize_blocks(w_NK)
    return gemm(q_x, s_x, q_w, s_w, out_dtype), (q_x, s_x, q_w, s_w)


def linear_backward(dy_MN: torch.Tensor, saved, dx_dtype: torch.dtype, want_dx: bool = True, want_dw: bool = True):
    """Dgrad and Wgrad from the forward's saved FP8 tensors -> (dx [M, K] in dx_dtype or None, dW [N, K] fp32 or
    None). dx = dy W: dy in 1x128 tiles along N, W^T's blocks (W's, transposed). dW = dy^T x: both in 1x128 tiles
    along the tokens, x^T re-tiled from the forward's FP8 x."""
    q_x, s_x, q_w, s_w = saved
    q_dy, s_dy, q_dyt, s_dyt = quantize_both(dy_MN)
    dx = gemm(q_dy, s_dy, q_w.t(), s_w.t(), dx_dtype) if want_dx else None
    dw = gemm(q_dyt, s_dyt, *requantize_t(q_x, s_x), torch.float32) if want_dw else None
    return dx, dw


def quantize_expert_blocks(w_ENK: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each expert's weight in 128x128 blocks: w [E, N, K] -> (q [E, N, K] E4M3, scales [E, NB, KB] fp32)."""
    E, N, K = w_ENK.shape
    wp = _pad_to(_pad_to(w_ENK.float(), 1), 2)
    NB, KB = wp.shape[1] // TILE, wp.shape[2] // TILE
    blocks = wp.view(E, NB, TILE, KB, TILE)
    s = _scale(blocks.abs().amax(dim=(2, 4)))
    q = (blocks / s[:, :, None, :, None]).to(E4M3).view(E, NB * TILE, KB * TILE)[:, :N, :K]
    return q.contiguous(), s


def grouped_gemm(a_RK: torch.Tensor, sa_RB: torch.Tensor, b_ENK: torch.Tensor, sb_E: torch.Tensor,
                 expert_M: torch.Tensor, rows_M: torch.Tensor, out_dtype: torch.dtype = torch.float32
                 ) -> torch.Tensor:  # fmt: skip
    """The routed experts' FP8 GEMM, row by row: C[r] = a[rows[r]] @ b[expert[r]]^T with `gemm`'s promotion ->
    [M, N] in out_dtype; a [R, K] with 1x128 scales [R, KB], b [E, N, K] with 128x128 block scales [E, NB, KB],
    expert_M and rows_M int [M] (an expert id of E or more: no expert, a zero row)."""
    out = torch.zeros(expert_M.numel(), b_ENK.shape[1], dtype=torch.float32, device=a_RK.device)
    for e in range(b_ENK.shape[0]):
        at = (expert_M == e).nonzero().flatten()
        if at.numel():
            rows = rows_M[at].long()
            out[at] = gemm(a_RK[rows], sa_RB[rows], b_ENK[e], sb_E[e], torch.float32)
    return out.to(out_dtype)


# ------------------------------------------------------------------------------------------------ the routed experts


def swiglu_weighted(h_MF: torch.Tensor, w_M: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up * w per row, in fp32 (h = [gate | up] [M, 2I], w [M]) -> [M, I] fp32."""
    g, u = h_MF.float().chunk(2, dim=-1)
    return torch.nn.functional.silu(g) * u * w_M.float()[:, None]


def dswiglu_weighted(h_MF: torch.Tensor, w_M: torch.Tensor, d_act_MI: torch.Tensor):
    """The gradients of `swiglu_weighted` -> (dh [M, 2I] fp32, dw [M] fp32)."""
    g, u = h_MF.float().chunk(2, dim=-1)
    sig = torch.sigmoid(g)
    silu = g * sig
    d = d_act_MI.float()
    dw = (silu * u * d).sum(-1)
    d = d * w_M.float()[:, None]
    return torch.cat([d * u * sig * (1 + g * (1 - sig)), d * silu], dim=-1), dw


def _routing(topk_ids_TK: torch.Tensor, E: int):
    """(slot [M], tok [M], expert [M]) of the T*K slots sorted by expert (stable), slots of id E last."""
    ids = topk_ids_TK.reshape(-1)
    slot = torch.sort(ids, stable=True)[1]
    return slot, slot // topk_ids_TK.shape[1], ids[slot]


def experts_forward(x_TD, topk_ids_TK, topk_weights_TK, gate_up_EFD, down_EDI):
    """The routed experts in FP8 (see `kernels.fp8_routed_experts`): x in 1x128 tiles with power-of-two scales (per
    token, before the gather; the values expert parallelism's FP8 dispatch sends, `pack_rows`, come out the same),
    each expert's weights in 128x128 blocks, gate|up by the promoted grouped GEMM (h in x's dtype), the weighted
    SwiGLU in fp32 quantized per 1x128 tile, down likewise, the K rows of a token summed in fp32. -> (y [T, D] in x's
    dtype, saved: what `experts_backward` reads)."""
    T, K = topk_ids_TK.shape
    E = gate_up_EFD.shape[0]
    slot, tok, expert = _routing(topk_ids_TK, E)
    q_x, s_x = quantize_rows(x_TD, pow2=True)
    q_gu, s_gu = quantize_expert_blocks(gate_up_EFD)
    q_dn, s_dn = quantize_expert_blocks(down_EDI)
    h = grouped_gemm(q_x, s_x, q_gu, s_gu, expert, tok, x_TD.dtype)
    w_M = topk_weights_TK.reshape(-1)[slot]
    q_act, s_act = quantize_rows(swiglu_weighted(h, w_M))
    y_rows = grouped_gemm(q_act, s_act, q_dn, s_dn, expert, torch.arange(len(slot), device=x_TD.device), x_TD.dtype)
    y_slot = torch.zeros(T * K, y_rows.shape[1], dtype=torch.float32, device=x_TD.device)
    y_slot[slot] = y_rows.float()
    saved = (q_x, s_x, h, q_act, s_act, q_gu, s_gu, q_dn, s_dn, topk_ids_TK, topk_weights_TK)
    return y_slot.view(T, K, -1).sum(1).to(x_TD.dtype), saved


def experts_backward(dy_TD: torch.Tensor, saved):
    """-> (dx [T, D] in dy's dtype, d topk_weights [T, K] fp32, d gate_up [E, F, D] fp32, d down [E, D, I] fp32).
    d_act = dy[tok] W_down (dy per 1x128 tile with power-of-two scales, as expert parallelism sends it to the
    experts, the blocks transposed), through the weighted SwiGLU in fp32 to dh (rounded to dy's dtype, quantized per
    1x128 tile), dx = dh W_gate_up summed over a token's K rows in fp32; the weight gradients over each expert's rows
    in 1x128 tiles along them (dh as it is, dy, act and x from their FP8 copies), fp32."""
    q_x, s_x, h, q_act, s_act, q_gu, s_gu, q_dn, s_dn, topk_ids_TK, topk_weights_TK = saved
    T, K = topk_ids_TK.shape
    E = q_gu.shape[0]
    slot, tok, expert = _routing(topk_ids_TK, E)
    rows = torch.arange(len(slot), device=dy_TD.device)
    q_dy, s_dy = quantize_rows(dy_TD, pow2=True)
    d_act = grouped_gemm(q_dy, s_dy, q_dn.transpose(1, 2), s_dn.transpose(1, 2), expert, tok, torch.float32)
    dh, dw_M = dswiglu_weighted(h, topk_weights_TK.reshape(-1)[slot], d_act)
    dh = dh.to(dy_TD.dtype)
    q_dh, s_dh = quantize_rows(dh)
    dx_rows = grouped_gemm(q_dh, s_dh, q_gu.transpose(1, 2), s_gu.transpose(1, 2), expert, rows, dy_TD.dtype)
    dx_slot = torch.zeros(T * K, dx_rows.shape[1], dtype=torch.float32, device=dy_TD.device)
    dx_slot[slot] = dx_rows.float()
    dw = torch.zeros(T * K, dtype=torch.float32, device=dy_TD.device)
    dw[slot] = dw_M
    x_deq, act_deq, dy_deq = dequantize_rows(q_x, s_x), dequantize_rows(q_act, s_act), dequantize_rows(q_dy, s_dy)
    d_gu = torch.zeros(q_gu.shape, dtype=torch.float32, device=dy_TD.device)
    d_dn = torch.zeros(q_dn.shape, dtype=torch.float32, device=dy_TD.device)
    for e in range(E):
        at = (expert == e).nonzero().flatten()
        if at.numel():
            d_dn[e] = gemm(*quantize_rows_t(dy_deq[tok[at]]), *quantize_rows_t(act_deq[at]))
            d_gu[e] = gemm(*quantize_rows_t(dh[at]), *quantize_rows_t(x_deq[tok[at]]))
    return dx_slot.view(T, K, -1).sum(1).to(dy_TD.dtype), dw.view(T, K), d_gu, d_dn
