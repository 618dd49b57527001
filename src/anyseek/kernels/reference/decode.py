"""Reference MLA decode attention over a paged latent cache (pure PyTorch): the fallback and the test oracle.

The cache of one layer is `cache [num_blocks, page, L + R]`: per token the normalized kv_a latent (L =
kv_lora_rank values) then the rotated k_pe (R values), shared by every head. Each query row t reads the pages
block_table[t, :] in order and attends to its first kv_lens[t] tokens (absorbed form: W_UK already folded into q):

    s[h, j] = scale * (q[t, h, :L] . c[j, :L] + q[t, h, L:] . c[j, L:]),   out[t, h] = softmax_j(s[h]) @ c[:, :L]

Shape legend: T query rows, H heads, L kv_lora_rank, R rope dim, X = L + R, M table width (pages), P page size.
"""

from __future__ import annotations

import math

import torch


def check_decode_shapes(q_THX: torch.Tensor, cache_NPX: torch.Tensor, block_table_TM: torch.Tensor,
                        kv_lens_T: torch.Tensor, kv_lora_rank: int) -> None:  # fmt: skip
    """Raise ValueError naming the first input that breaks the contract of `mla_decode`."""
    if q_THX.dim() != 3 or cache_NPX.dim() != 3 or q_THX.shape[-1] != cache_NPX.shape[-1]:
        raise ValueError(f"mla_decode: q [T, H, X] and cache [blocks, page, X] must share X; got "
                         f"{tuple(q_THX.shape)} and {tuple(cache_NPX.shape)}")  # fmt: skip
    if not 0 < kv_lora_rank < q_THX.shape[-1]:
        raise ValueError(f"mla_decode: kv_lora_rank {kv_lora_rank} must be in (0, {q_THX.shape[-1]})")
    T = q_THX.shape[0]
    if block_table_TM.dim() != 2 or block_table_TM.shape[0] != T or kv_lens_T.shape != (T,):
        raise ValueError(f"mla_decode: block_table must be [T, M] and kv_lens [T] with T = {T}; got "
                         f"{tuple(block_table_TM.shape)} and {tuple(kv_lens_T.shape)}")  # fmt: skip
    if block_table_TM.dtype not in (torch.int32, torch.int64) or kv_lens_T.dtype not in (torch.int32, torch.int64):
        raise ValueError("mla_decode: block_table and kv_lens must be int32 or int64")


def mla_decode(
    q_THX: torch.Tensor,
    cache_NPX: torch.Tensor,
    block_table_TM: torch.Tensor,
    kv_lens_T: torch.Tensor,
    kv_lora_rank: int,
    softmax_scale: float | None = None,
    compute_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """q [T, H, L+R], cache [N, P, L+R], block_table int [T, M], kv_lens int [T] (each >= 1, <= M*P)
    -> out [T, H, L] in q's dtype. softmax_scale defaults to 1/sqrt(L+R). compute_dtype: fp32 (the oracle) or the
    inputs' low precision (the yardstick of the 2x rule)."""
    check_decode_shapes(q_THX, cache_NPX, block_table_TM, kv_lens_T, kv_lora_rank)
    T, _, X = q_THX.shape
    P, L = cache_NPX.shape[1], kv_lora_rank
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(X)
    S = int(kv_lens_T.max()) if T else 0  # host sync: the oracle gathers only the pages some row needs
    M = min(block_table_TM.shape[1], -(-S // P))
    rows_TS = (block_table_TM[:, :M, None].long() * P + torch.arange(P, device=q_THX.device)).reshape(T, M * P)
    c_TSX = cache_NPX.reshape(-1, X)[rows_TS].to(compute_dtype)  # [T, M*P, X]
    s_THS = torch.bmm(q_THX.to(compute_dtype), c_TSX.transpose(1, 2)).float() * scale
    valid_TS = torch.arange(M * P, device=q_THX.device)[None, :] < kv_lens_T[:, None]
    p_THS = torch.softmax(s_THS.masked_fill(~valid_TS[:, None, :], float("-inf")), dim=-1)
    out_THL = torch.bmm(p_THS.to(compute_dtype), c_TSX[:, :, :L])
    return out_THL.to(q_THX.dtype)
