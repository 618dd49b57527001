"""Pick a backend per op. (Minimal version; the Triton issue grows it: priorities, availability checks with
reasons, ANYSEEK_<OP> / explicit requests that raise, one warning on automatic fallback.)"""

from __future__ import annotations

from typing import Callable

import torch


def _reference(op: str) -> Callable:
    from anyseek.kernels import reference

    return getattr(reference, op)


def get(op: str, example: torch.Tensor) -> Callable:
    """The function that runs `op` for tensors like `example`."""
    return _reference(op)
