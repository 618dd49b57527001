"""The attention seams' input contract, checked once where the model enters a seam (`anyseek.kernels`), never again
in the backends. Shapes, dtypes and devices are checked on every call (no device sync). cu_seqlens' values (start
at 0, never decrease, end at T) are checked here only when they sit on the CPU; on a GPU that would cost a sync per
call, and the model checks them once per forward when it builds its `PackedLayout`.

Shape legend: T tokens, H heads, C = N + R query/key dim, N nope dim, R rope dim, V value dim, B documents.
"""

from __future__ import annotations

import torch


def check_cu_seqlens(cu_seqlens: torch.Tensor, T: int, device: torch.device) -> None:
    """Raise ValueError unless cu_seqlens is a 1-D integer tensor [B+1] on `device` (and, on the CPU, rises from 0
    to T)."""
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2 or cu_seqlens.dtype not in (torch.int32, torch.int64):
        raise ValueError(
            f"cu_seqlens must be a 1-D int32 tensor [B+1], got shape {tuple(cu_seqlens.shape)} {cu_seqlens.dtype}"
        )
    if cu_seqlens.device != device:
        raise ValueError(f"cu_seqlens must be on {device} like q, got {cu_seqlens.device}")
    if cu_seqlens.device.type == "cpu":
        first, last = int(cu_seqlens[0]), int(cu_seqlens[-1])
        if first != 0 or last != T or bool((cu_seqlens.diff() < 0).any()):
            raise ValueError(f"cu_seqlens must start at 0, never decrease and end at the token count {T}; "
                             f"got {first}..{last}")


def check_mla(q_THC, k_nope_THN, k_pe_TR, v_THV, cu_seqlens) -> None:
    """Raise ValueError naming the tensor whose shape does not fit MLA's split form."""
    if q_THC.dim() != 3 or k_nope_THN.dim() != 3 or k_pe_TR.dim() != 2 or v_THV.dim() != 3:
        raise ValueError(
            "mla_attention expects q [T, H, N+R], k_nope [T, H, N], k_pe [T, R], v [T, H, V]; got "
            f"q {tuple(q_THC.shape)}, k_nope {tuple(k_nope_THN.shape)}, k_pe {tuple(k_pe_TR.shape)}, "
            f"v {tuple(v_THV.shape)}"
        )
    T, H, C = q_THC.shape
    N, R = k_nope_THN.shape[-1], k_pe_TR.shape[-1]
    if k_nope_THN.shape[:2] != (T, H) or v_THV.shape[:2] != (T, H) or k_pe_TR.shape[0] != T or N + R != C:
        raise ValueError(
            f"mla_attention shapes disagree: q {tuple(q_THC.shape)} needs k_nope [{T}, {H}, N], k_pe [{T}, R] "
            f"with N+R={C}, v [{T}, {H}, V]; got k_nope {tuple(k_nope_THN.shape)}, k_pe {tuple(k_pe_TR.shape)}, "
            f"v {tuple(v_THV.shape)}"
        )
    check_cu_seqlens(cu_seqlens, T, q_THC.device)


def check_varlen(q_THD, k_THD, v_THV, cu_seqlens) -> None:
    """Raise ValueError naming the tensor whose shape does not fit varlen attention."""
    if q_THD.dim() != 3 or k_THD.shape != q_THD.shape or v_THV.dim() != 3 or v_THV.shape[:2] != q_THD.shape[:2]:
        raise ValueError(
            "varlen_attention expects q [T, H, D], k [T, H, D], v [T, H, V]; got "
            f"q {tuple(q_THD.shape)}, k {tuple(k_THD.shape)}, v {tuple(v_THV.shape)}"
        )
    check_cu_seqlens(cu_seqlens, q_THD.shape[0], q_THD.device)
