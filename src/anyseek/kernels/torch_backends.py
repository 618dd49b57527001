"""Backends built from PyTorch ops alone, differentiable through autograd: attention (`sdpa`, `bmm`) and the
routed experts through `torch._grouped_mm` (`grouped_mm`).

`sdpa`: gather the documents of a packed batch into padded [n, Lmax] batches, bucketed by length so that one
long document does not pad a thousand short ones, and call `F.scaled_dot_product_attention` once per bucket.
With causal masking a valid query never sees a padded key (padding sits at the end of each row), so no mask
tensor is built; with causal=False a key-padding mask is passed. MLA's shared k_pe is expanded per head only
inside the call.

`grouped_mm`: the reference experts' permutation and combine around two `torch._grouped_mm` calls (cuBLAS grouped
GEMM; fused only on sm90+ with bf16, hence its availability check); for LoRA's experts, on the effective weights.

Shape legend: T tokens in the packed batch, H heads, C = N + R query/key dim, N nope dim, R rope dim, V value
dim, n documents in one bucket, L the bucket's padded length; K experts per token, E experts, I expert width,
M = T*K routed rows, F = 2*I.
"""

from __future__ import annotations

import itertools
import math

import torch
import torch.nn.functional as F

from anyseek.kernels.reference import moe as moe_ref

# Documents whose lengths share a bucket differ by at most this factor, so padding wastes < 1 - 1/GROWTH.
_BUCKET_GROWTH = 1.5


def _buckets(lengths: list[int]) -> list[list[int]]:
    """Document indices grouped by length (longest bucket first); empty documents are dropped."""
    order = sorted((i for i, n in enumerate(lengths) if n > 0), key=lambda i: lengths[i])
    groups: list[list[int]] = []
    lo = 0
    for i in order:
        if not groups or lengths[i] > lo * _BUCKET_GROWTH:
            groups.append([])
            lo = lengths[i]
        groups[-1].append(i)
    return groups[::-1]


def _bucket_index(starts: list[int], lengths: list[int], docs: list[int], device) -> tuple[torch.Tensor, torch.Tensor]:
    """idx [n, L] token positions (padding points at the document's first token), valid [n, L] bool."""
    L = max(lengths[d] for d in docs)
    start_n = torch.tensor([starts[d] for d in docs], dtype=torch.long, device=device)
    len_n = torch.tensor([lengths[d] for d in docs], dtype=torch.long, device=device)
    pos_L = torch.arange(L, dtype=torch.long, device=device)
    valid_nL = pos_L[None, :] < len_n[:, None]
    idx_nL = start_n[:, None] + torch.where(valid_nL, pos_L[None, :], 0)
    return idx_nL, valid_nL


def _padded_sdpa(q_THC, k_THC, v_THV, cu_seqlens, softmax_scale, causal, tiles: bool = False) -> torch.Tensor:
    """Shared driver: q, k [T, H, C], v [T, H, V] -> out [T, H, V].

    Every input is gathered once for all buckets with index_select (its backward is an index_add; plain advanced
    indexing would backpropagate through a much slower accumulating index_put on CPU), and the output is gathered
    back the same way. tiles=True runs causal buckets of length <= _TILED_MAX_LEN through `_TiledCausal` (batched
    matmuls), the others through SDPA."""
    T, H, C = q_THC.shape
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(C)
    bounds = cu_seqlens.tolist()  # host sync: this backend sizes its buckets on the host (checked at the seam)
    starts, lengths = bounds[:-1], [e - s for s, e in itertools.pairwise(bounds)]
    buckets = [_bucket_index(starts, lengths, docs, q_THC.device) for docs in _buckets(lengths)]
    if not buckets:
        return v_THV.new_zeros(T, H, v_THV.shape[-1]).to(q_THC.dtype)
    Vd = v_THV.shape[-1]
    # equal documents ([B, S] rows): one bucket without padding, already in order; nothing to gather
    identity = len(set(lengths)) == 1
    if identity:
        q_all, k_all, v_all = q_THC, k_THC, v_THV
    else:
        flat = torch.cat([idx_nL.reshape(-1) for idx_nL, _ in buckets])  # (F,) padded slots of every bucket
        q_all, k_all, v_all = (x.index_select(0, flat) for x in (q_THC, k_THC, v_THV))
    outs = []
    sizes = [idx_nL.numel() for idx_nL, _ in buckets]  # split, not slices: its backward is one cat, not zero-filled
    for (idx_nL, valid_nL), *qkv in zip(buckets, *(x.split(sizes) for x in (q_all, k_all, v_all))):  # full copies
        n, L = idx_nL.shape
        if tiles and causal and L <= _TILED_MAX_LEN:
            q, k, v = (x.view(n, L, H, -1).transpose(1, 2).reshape(n * H, L, -1) for x in qkv)  # (n*H, L, .)
            o = _TiledCausal.apply(q, k, v, scale)
            outs.append(o.view(n, H, L, Vd).transpose(1, 2).reshape(n * L, H, Vd))
            continue
        q, k, v = (x.view(n, L, H, -1).transpose(1, 2) for x in qkv)  # (n, H, L, .)
        if q.device.type == "cpu" and Vd < C:  # the CPU flash kernel needs d_v == d_qk; the math path is 2x slower
            v = F.pad(v, (0, C - Vd))
        mask = None if causal else valid_nL[:, None, None, :]
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, scale=scale)
        outs.append(o[..., :Vd].transpose(1, 2).reshape(n * L, H, Vd))
    if identity:
        return outs[0].to(q_THC.dtype)
    valid = torch.cat([valid_nL.reshape(-1) for _, valid_nL in buckets])
    pos = torch.empty(T, dtype=torch.long, device=flat.device)  # each token's slot in the padded buckets
    pos[flat[valid]] = torch.nonzero(valid).squeeze(1)
    return torch.cat(outs).index_select(0, pos).to(q_THC.dtype)


# Causal buckets up to this length go through _TiledCausal (it keeps the softmax probabilities for the backward,
# H * L * (L/2 + tile) floats per document; longer documents go to SDPA, whose memory is linear in L).
_TILED_MAX_LEN = 1024
_TILE = 64  # query rows per tile: measured on 2 cores for L = 64..1024, head dims 48/32


def _tile_scores(qs_BtC: torch.Tensor, k_BLC: torch.Tensor, s: int, e: int, above_tt: torch.Tensor) -> torch.Tensor:
    """Scaled scores of query rows s:e against keys 0:e, causal: [B, e-s, e]. Only the last (e-s) columns, the
    diagonal block, hold masked entries: above_tt [_TILE, _TILE] is True above the diagonal."""
    sc_BtL = torch.bmm(qs_BtC, k_BLC[:, :e].transpose(1, 2))
    sc_BtL[:, :, s:e].masked_fill_(above_tt[: e - s, : e - s], -math.inf)
    return sc_BtL


class _TiledCausal(torch.autograd.Function):
    """Causal attention of B independent sequences, q, k [B, L, C], v [B, L, V] -> [B, L, V], through batched
    matmuls in query tiles: tile [s, e) sees keys [0, e), so the work is ~L^2/2 + L*tile rather than L^2, and each
    tile's softmax probabilities are kept for the backward. For CPUs, where PyTorch's flash kernel runs small head
    dims (MLA's 48/32 in the tiny flavor) at a fraction of the matmul rate: 20-35% faster forward + backward than
    SDPA over L = 64..1024 on 2 cores, and v needs no padding to q's head dim."""

    @staticmethod
    def forward(ctx, q_BLC, k_BLC, v_BLV, scale: float):
        L = q_BLC.shape[1]
        qs_BLC = q_BLC * scale
        above_tt = torch.ones(_TILE, _TILE, dtype=torch.bool, device=q_BLC.device).triu_(1)
        probs, outs = [], []
        for s in range(0, L, _TILE):
            e = min(L, s + _TILE)
            p_BtL = torch.softmax(_tile_scores(qs_BLC[:, s:e], k_BLC, s, e, above_tt), dim=-1)
            outs.append(torch.bmm(p_BtL, v_BLV[:, :e]))  # (bmm out= into a strided slice is slower than a cat)
            probs.append(p_BtL)
        out_BLV = torch.cat(outs, dim=1)
        ctx.save_for_backward(qs_BLC, k_BLC, v_BLV, out_BLV, *probs)
        ctx.scale = scale
        return out_BLV

    @staticmethod
    def backward(ctx, do_BLV):
        qs_BLC, k_BLC, v_BLV, out_BLV, *probs = ctx.saved_tensors
        L = qs_BLC.shape[1]
        do_BLV = do_BLV.contiguous()
        delta_BL1 = (do_BLV * out_BLV).sum(dim=-1, keepdim=True)  # sum_j p_ij dp_ij = do_i . o_i
        dk_BLC, dv_BLV = torch.zeros_like(k_BLC), torch.zeros_like(v_BLV)
        dqs = []
        for p_BtL, s in zip(probs, range(0, L, _TILE)):
            e = min(L, s + _TILE)
            do_BtV = do_BLV[:, s:e]
            dv_BLV[:, :e] += torch.bmm(p_BtL.transpose(1, 2), do_BtV)  # (baddbmm_ into a slice loops per batch)
            ds_BtL = torch.bmm(do_BtV, v_BLV[:, :e].transpose(1, 2)).sub_(delta_BL1[:, s:e]).mul_(p_BtL)
            dqs.append(torch.bmm(ds_BtL, k_BLC[:, :e]))
            dk_BLC[:, :e] += torch.bmm(ds_BtL.transpose(1, 2), qs_BLC[:, s:e])
        return torch.cat(dqs, dim=1).mul_(ctx.scale), dk_BLC, dv_BLV, None


def sdpa_mla_attention(
    q_THC: torch.Tensor,
    k_nope_THN: torch.Tensor,
    k_pe_TR: torch.Tensor,
    v_THV: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int | None = None,
    softmax_scale: float | None = None,
    causal: bool = True,
    tiles: bool = False,
) -> torch.Tensor:
    """MLA attention through padded SDPA buckets (tiles=True: causal buckets through batched-matmul tiles).
    Shapes as `anyseek.kernels.mla_attention`; out [T, H, V]."""
    k_nope_THN, v_THV = k_nope_THN.to(q_THC.dtype), v_THV.to(q_THC.dtype)  # mixed dtypes under autocast
    T, H, _ = q_THC.shape
    # k_pe expanded over heads only inside this call; from fp32, so that the backward sums dk_pe over heads in fp32
    k_pe_THR = k_pe_TR.float()[:, None, :].expand(T, H, -1).to(k_nope_THN.dtype)
    k_THC = torch.cat([k_nope_THN, k_pe_THR], dim=-1)
    return _padded_sdpa(q_THC, k_THC, v_THV, cu_seqlens, softmax_scale, causal, tiles)


def sdpa_varlen_attention(
    q_THD: torch.Tensor,
    k_THD: torch.Tensor,
    v_THV: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int | None = None,
    softmax_scale: float | None = None,
    causal: bool = True,
    tiles: bool = False,
) -> torch.Tensor:
    """Varlen attention through padded SDPA buckets (tiles=True: causal buckets through batched-matmul tiles).
    Shapes as `anyseek.kernels.varlen_attention`."""
    k_THD, v_THV = k_THD.to(q_THD.dtype), v_THV.to(q_THD.dtype)
    return _padded_sdpa(q_THD, k_THD, v_THV, cu_seqlens, softmax_scale, causal, tiles)


def sdpa_available(example: torch.Tensor) -> tuple[bool, str]:
    """SDPA runs on every device PyTorch supports; scale= needs torch >= 2.1."""
    if "scale" not in F.scaled_dot_product_attention.__doc__:
        return False, "this PyTorch's scaled_dot_product_attention takes no scale= argument (needs torch >= 2.1)"
    return True, f"PyTorch SDPA on {example.device.type}, documents padded in length buckets"


def bmm_mla_attention(q_THC, k_nope_THN, k_pe_TR, v_THV, cu_seqlens, max_seqlen=None, softmax_scale=None, causal=True):
    """The `bmm` backend of mla_attention: causal documents up to 1024 tokens through `_TiledCausal`."""
    return sdpa_mla_attention(q_THC, k_nope_THN, k_pe_TR, v_THV, cu_seqlens, max_seqlen, softmax_scale, causal, True)


def bmm_varlen_attention(q_THD, k_THD, v_THV, cu_seqlens, max_seqlen=None, softmax_scale=None, causal=True):
    """The `bmm` backend of varlen_attention: causal documents up to 1024 tokens through `_TiledCausal`."""
    return sdpa_varlen_attention(q_THD, k_THD, v_THV, cu_seqlens, max_seqlen, softmax_scale, causal, True)


def bmm_available(example: torch.Tensor) -> tuple[bool, str]:
    """fp32/fp64 only: the tiles take softmax and matmuls in the input dtype (bf16 would lose the fp32 accumulation
    that SDPA's kernels keep)."""
    if example.dtype not in (torch.float32, torch.float64):
        return False, f"batched-matmul tiles compute in the input dtype; {example.dtype} goes to SDPA"
    if torch.is_autocast_enabled(example.device.type):
        return False, "autocast is on (matmuls would run in the autocast dtype); SDPA instead"
    return True, (f"PyTorch batched matmuls in causal query tiles of {_TILE} (documents up to {_TILED_MAX_LEN} "
                  "tokens; longer ones through SDPA), documents padded in length buckets")


# ---------------------------------------------------------------- routed experts


def grouped_mm_routed_experts(
    x_TD: torch.Tensor,
    topk_ids_TK: torch.Tensor,
    topk_weights_TK: torch.Tensor,
    gate_up_proj_EFD: torch.Tensor,
    down_proj_EDI: torch.Tensor,
    add_TD: torch.Tensor | None = None,
) -> torch.Tensor:
    """The `grouped_mm` backend of routed_experts (add_TD: added to the output): the reference maths
    (`kernels.reference.moe`) through `torch._grouped_mm` (bf16, CUDA sm90+): no host sync and two matmul launches
    per call instead of two per expert. Check `grouped_mm_available` first."""
    E, I = gate_up_proj_EFD.shape[0], down_proj_EDI.shape[-1]
    out_dtype = x_TD.dtype
    if torch.is_autocast_enabled(x_TD.device.type):  # autocast does not cover _grouped_mm: cast as it would
        dtype = torch.get_autocast_dtype(x_TD.device.type)
        x_TD, gate_up_proj_EFD, down_proj_EDI = (t.to(dtype) for t in (x_TD, gate_up_proj_EFD, down_proj_EDI))
    topk_ids_TK, topk_weights_TK = moe_ref.no_expert_rows(topk_ids_TK, topk_weights_TK, E)
    x_MD, order_M, counts_E = moe_ref.permute(x_TD, topk_ids_TK, E)
    offs_E = counts_E.cumsum(0).to(torch.int32)  # stays on the device
    h_MF = torch._grouped_mm(x_MD, gate_up_proj_EFD.transpose(1, 2), offs=offs_E)
    act_MI = F.silu(h_MF[:, :I]) * h_MF[:, I:]
    y_MD = torch._grouped_mm(act_MI, down_proj_EDI.transpose(1, 2), offs=offs_E)
    y_TD = moe_ref.unpermute(y_MD, order_M, topk_weights_TK).to(out_dtype)
    return y_TD if add_TD is None else y_TD + add_TD


def grouped_mm_lora_routed_experts(x_TD, topk_ids_TK, topk_weights_TK, gate_up_EFD, down_EDI, A_gu, B_gu, A_dn, B_dn,
                                   scale: float, add_TD: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
    """The `grouped_mm` backend of lora_routed_experts: `grouped_mm_routed_experts` on the effective weights
    (`reference.moe.effective_weights`), whose [E, F, D] gradient autograd reduces to the adapters'."""
    gu, dn = (moe_ref.effective_weights(W, A, B, scale) for W, A, B in ((gate_up_EFD, A_gu, B_gu),
                                                                        (down_EDI, A_dn, B_dn)))  # fmt: skip
    return grouped_mm_routed_experts(x_TD, topk_ids_TK, topk_weights_TK, gu, dn, add_TD=add_TD)


def grouped_mm_available(example: torch.Tensor) -> tuple[bool, str]:
    """(ok, reason) for `grouped_mm_routed_experts` on tensors like `example`."""
    if not hasattr(torch, "_grouped_mm"):
        return False, f"torch {torch.__version__} has no torch._grouped_mm (needs >= 2.8)"
    if example.device.type != "cuda" or torch.cuda.get_device_capability(example.device) < (9, 0):
        return False, "torch._grouped_mm needs an NVIDIA GPU of compute capability 9.0 or newer"
    autocast_bf16 = torch.is_autocast_enabled("cuda") and torch.get_autocast_dtype("cuda") == torch.bfloat16
    if example.dtype != torch.bfloat16 and not autocast_bf16:
        return False, f"torch._grouped_mm needs bf16 (or bf16 autocast), got {example.dtype}"
    return True, "torch._grouped_mm (cuBLAS grouped GEMM), no host sync"
