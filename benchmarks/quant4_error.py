"""Which 4-bit code for frozen bases: NF4 or int4, per-64 or per-128 group scales, fp32 or bf16 scales (CPU).

    python benchmarks/quant4_error.py [--rows 2048] [--cols 2048] [--seeds 3]

For each candidate it quantizes [rows, cols] weights and reports, as a markdown table, the relative Frobenius error
||W - Q(W)|| / ||W|| and the matmul output error ||x W^T - x Q(W)^T|| / ||x W^T|| (x: random-normal rows), on two
kinds of weights: random normal, and heavy-tailed "trained-like" weights (Student-t with 4 degrees of freedom, a few
input columns scaled up 8x, as trained projections have outlier channels). The candidates are written here from their
definitions (NF4: 16 levels at quantiles of the standard normal, symmetric about an exact zero, scaled by each group's
absmax; int4: the 15 integers -7..7 times absmax / 7), independently of `kernels/reference/quant4.py`.
"""

from __future__ import annotations

import argparse

import torch


def nf4_levels() -> torch.Tensor:
    """16 levels in [-1, 1]: 8 positive and 7 negative normal quantiles and an exact 0, normalized by the largest."""
    p = torch.tensor(0.5 * (1 + 0.9677), dtype=torch.float64)  # the outermost quantile's probability (QLoRA's offset)
    pos = torch.special.ndtri(torch.linspace(float(p), 0.5, 9, dtype=torch.float64)[:-1])
    neg = -torch.special.ndtri(torch.linspace(float(p), 0.5, 8, dtype=torch.float64)[:-1])
    levels = torch.cat([neg, torch.zeros(1, dtype=torch.float64), pos]).sort().values
    return levels / levels.abs().max()


def quantize(w: torch.Tensor, kind: str, group: int, scale_dtype: torch.dtype) -> torch.Tensor:
    """Q(w): quantize and dequantize in fp64, the scales rounded to scale_dtype."""
    g = w.double().reshape(w.shape[0], -1, group)
    absmax = g.abs().amax(-1, keepdim=True)
    if kind == "int4":
        scale = (absmax / 7).to(scale_dtype).double()
        q = (g / scale.clamp_min(1e-30)).round().clamp(-7, 7) * scale
    else:
        levels = nf4_levels()
        scale = absmax.to(scale_dtype).double()
        idx = (g / scale.clamp_min(1e-30))[..., None].sub(levels).abs().argmin(-1)
        q = levels[idx] * scale
    return q.reshape(w.shape)


def weights(kind: str, rows: int, cols: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    if kind == "normal":
        return torch.randn(rows, cols, generator=gen, dtype=torch.float64) * 0.02
    t = torch.distributions.StudentT(4.0)
    torch.manual_seed(seed)
    w = t.sample((rows, cols)).double() * 0.02
    outliers = torch.randperm(cols, generator=gen)[: max(1, cols // 128)]
    w[:, outliers] *= 8
    return w


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=2048)
    ap.add_argument("--cols", type=int, default=2048)
    ap.add_argument("--seeds", type=int, default=3)
    args = ap.parse_args()
    cands = [("int4", 64, torch.float32), ("int4", 64, torch.bfloat16), ("int4", 128, torch.bfloat16),
             ("nf4", 64, torch.float32), ("nf4", 64, torch.bfloat16), ("nf4", 128, torch.bfloat16)]
    print("| code | group | scales | bits/weight | normal: rel. Frobenius | normal: matmul | heavy-tailed: rel. "
          "Frobenius | heavy-tailed: matmul |")
    print("|---|---|---|---|---|---|---|---|")
    for kind, group, sdt in cands:
        cells = []
        for wkind in ("normal", "heavy"):
            fro = mm = 0.0
            for seed in range(args.seeds):
                w = weights(wkind, args.rows, args.cols, seed)
                q = quantize(w, kind, group, sdt)
                x = torch.randn(256, args.cols, generator=torch.Generator().manual_seed(100 + seed),
                                dtype=torch.float64)
                fro += float((w - q).norm() / w.norm()) / args.seeds
                mm += float((x @ (w - q).t()).norm() / (x @ w.t()).norm()) / args.seeds
            cells += [f"{fro:.4f}", f"{mm:.4f}"]
        bits = 4 + (32 if sdt == torch.float32 else 16) / group
        print(f"| {kind} | {group} | {str(sdt).removeprefix('torch.')} | {bits:.3f} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
