"""Can the Triton attention kernels run on tensors like `example`? Imports Triton only when asked."""

from __future__ import annotations

import os

import torch

MAX_HEAD_DIM = 256
DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "") == "1"


def available(example: torch.Tensor) -> tuple[bool, str]:
    """(ok, reason) for the Triton backend on `example`'s device, dtype and last dim (the q head dim)."""
    dev = example.device
    if dev.type != "cuda" and not (dev.type == "cpu" and interpreting()):
        return False, f"needs a CUDA GPU (tensor is on {dev.type}; TRITON_INTERPRET=1 runs it slowly on CPU)"
    try:
        import triton
    except ImportError as e:
        return False, f"triton is not installed ({e}); pip install 'anyseek[gpu]'"
    if example.dtype not in DTYPES:
        return False, f"dtype {example.dtype} not supported (fp16, bf16, fp32)"
    if example.shape[-1] > MAX_HEAD_DIM:
        return False, f"head dim {example.shape[-1]} > {MAX_HEAD_DIM}"
    if dev.type == "cuda":
        if torch.version.hip is not None:
            return False, "ROCm build: the kernels are tuned and tested for NVIDIA GPUs only"
        major, minor = torch.cuda.get_device_capability(dev)
        if major < 8:
            return False, f"compute capability {major}.{minor} < 8.0 (needs Ampere or newer)"
        return True, f"Triton {triton.__version__} kernel on sm_{major}{minor}"
    return True, f"Triton {triton.__version__} interpreter (TRITON_INTERPRET=1)"


def moe_available(example: torch.Tensor) -> tuple[bool, str]:
    """(ok, reason) for the Triton routed-experts kernels on tensors like `example` (x [T, D]; no width limit)."""
    ok, reason = available(example.reshape(-1)[:1])
    if not ok or example.device.type != "cuda":
        return ok, reason
    from anyseek.kernels.triton.moe_family import why

    return True, f"{reason}: {why(torch.cuda.get_device_capability(example.device))}"


def fp8_available(example: torch.Tensor) -> tuple[bool, str]:
    """(ok, reason) for the Triton FP8 kernels (`kernels.fp8_linear`): E4M3 tensor cores, compute capability 8.9+."""
    ok, reason = available(example.reshape(-1)[:1])
    if not ok or example.device.type != "cuda":
        return ok, reason
    major, minor = torch.cuda.get_device_capability(example.device)
    if (major, minor) < (8, 9):
        return False, f"compute capability {major}.{minor} has no FP8 tensor cores (needs 8.9+: Ada, Hopper, Blackwell)"
    return True, f"{reason} (E4M3 tensor cores)"
