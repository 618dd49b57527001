"""Which routed-experts backend each GPU family gets, and why (for the registry's reasons and `anyseek doctor`).
Pure Python: imports neither Triton nor CUDA."""

from __future__ import annotations

# (family, compute capabilities, launch-settings row in moe.py's table, what torch._grouped_mm does there)
FAMILIES = [
    ("Ampere datacenter (A100)", ((8, 0),), "ampere_dc", "falls back to a per-expert matmul loop with a host sync"),
    ("Ampere/Ada consumer (RTX 30xx/40xx, A10, L4, L40)", ((8, 6), (8, 7), (8, 9)), "consumer",
     "falls back to a per-expert matmul loop with a host sync"),
    ("Hopper (H100/H200)", ((9, 0),), "hopper", "fused CUTLASS grouped GEMM, bf16 only"),
    ("Blackwell datacenter (B200/GB200)", ((10, 0), (10, 3)), "hopper", "fused CUTLASS grouped GEMM, bf16 only"),
    ("Blackwell consumer (RTX 50xx, RTX PRO)", ((12, 0), (12, 1)), "consumer",
     "falls back to a per-expert loop (reported crashing or disabled on sm_120)"),
]  # fmt: skip


# why triton sits ahead of grouped_mm in the registry (benchmarks/moe.py; docs/benchmarks.md)
MEASURED = "faster forward+backward at every benchmarked shape on an H100"


def family(cc: tuple[int, int]) -> str:
    """The launch-settings row for a compute capability (unknown newer GPUs: the consumer row, the smallest)."""
    for _, ccs, row, _ in FAMILIES:
        if cc in ccs:
            return row
    return "hopper" if cc[0] in (9, 10) else "consumer"


def why(cc: tuple[int, int]) -> str:
    """One line: what the triton backend is on this GPU, against torch._grouped_mm."""
    for name, ccs, _, grouped in FAMILIES:
        if cc in ccs:
            return f"{name}: grouped GEMM with fused gather/SwiGLU/scatter; torch._grouped_mm here {grouped}"
    return f"sm_{cc[0]}{cc[1]}: grouped GEMM with fused gather/SwiGLU/scatter"


def doctor_lines(chain: list[str]) -> list[str]:
    """`anyseek doctor`: the routed_experts backend per GPU family, bf16, for the registry's priority order `chain`
    (an fp16 model never gets grouped_mm: it is bf16 only)."""
    lines = ["routed_experts by GPU family (bf16; ANYSEEK_MOE=name overrides):"]
    for name, ccs, _, grouped in FAMILIES:
        fused = "fused" in grouped
        pick = next((b for b in chain if b in ("triton", "reference") or (b == "grouped_mm" and fused)), "-")
        if pick == "triton" and fused:
            reason = f"ahead of torch._grouped_mm ({grouped}): {MEASURED}"
        elif pick == "triton":
            reason = f"torch._grouped_mm here {grouped}"
        else:
            reason = f"torch._grouped_mm: {grouped}"
        sm = "/".join(f"sm_{a}{b}" for a, b in ccs)
        lines.append(f"  {name} [{sm}]: {pick} ({reason})")
    return lines
