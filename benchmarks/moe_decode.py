"""The routed experts' forward at decoding sizes (no gradients; 16B expert shapes, uniform random routing): us a
layer and the expert weights' bytes read a second, with the "small_" launch settings (`triton/moe.py`, taken up
to SMALL_ROWS routed rows) against the training ones, and a sweep of candidate settings (--sweep).

Each timing replays a CUDA graph of L layers' forwards over L copies of the weights, so that they come from HBM as
in a model (one layer's experts, 1.1 GB, exceed the L2). The floor: the chosen experts' bytes at the GPU's bandwidth.

    python benchmarks/moe_decode.py [--batches 1,8,64,170] [--sweep] [--layers 8]"""

import argparse
import itertools
import json
import time

import torch

from anyseek.kernels.triton import moe as tri
from anyseek.kernels.triton.moe_plan import build_plan

p = argparse.ArgumentParser()
p.add_argument("--batches", default="1,8,64,170")
p.add_argument("--sweep", action="store_true")
p.add_argument("--layers", type=int, default=8)
p.add_argument("--bandwidth", type=float, default=4.8e12)
p.add_argument("--out", default=None, help="write the best settings found by --sweep (JSON)")
a = p.parse_args()
E, K, D, I = 64, 6, 2048, 1408
dev = torch.device("cuda")
fam = tri.family(dev)
torch.manual_seed(0)
weights = [(torch.randn(E, 2 * I, D, device=dev, dtype=torch.bfloat16) * 0.02,
            torch.randn(E, D, I, device=dev, dtype=torch.bfloat16) * 0.02) for _ in range(a.layers)]  # fmt: skip
per_expert = (2 * I * D + D * I) * 2


def inputs(T: int, seed: int = 1):
    g = torch.Generator(device=dev).manual_seed(seed)
    ids = torch.rand(T, E, generator=g, device=dev).argsort(-1)[:, :K].contiguous()
    w = torch.rand(T, K, generator=g, device=dev)
    x = torch.randn(T, D, generator=g, device=dev, dtype=torch.bfloat16)
    return x, ids, w.reshape(-1)


def step(x, ids, w_M, narrow: bool):
    out = []
    for gu, dn in weights:
        plan = build_plan(ids, E, tri.block_m(dev, narrow))
        out.append(tri.experts_fwd(x, w_M, gu, dn, plan, False, narrow=narrow)[0])
    return out


def time_us(T: int, narrow: bool) -> tuple[float, torch.Tensor]:
    """us a layer (graph replay), and layer 0's output."""
    x, ids, w_M = inputs(T)
    step(x, ids, w_M, narrow)  # compile
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = step(x, ids, w_M, narrow)
    g.replay()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(10):
        g.replay()
    torch.cuda.synchronize()
    return 1e6 * (time.perf_counter() - t) / 10 / a.layers, out[0].float()


def floor_us(T: int) -> float:
    ids = inputs(T)[1]
    return 1e6 * ids.unique().numel() * per_expert / a.bandwidth


def settings(sw, gm):
    tri._TABLE[fam]["small_swiglu"], tri._TABLE[fam]["small_gemm"] = sw, gm


batches = [int(b) for b in a.batches.split(",")]
ref = {T: time_us(T, False) for T in batches}
if a.sweep:
    results = []
    print("| GEMM, (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages) | batch 1 us | batch 64 us | max diff |")
    print("| --- | --- | --- | --- |")
    for bm in (16, 64):
        sw, gm = (bm, 32, 256, 4, 4), (bm, 64, 256, 4, 4)
        for kind in ("swiglu", "gemm"):
            best = None
            for bn, bk, warps, stages in [*itertools.product((32, 64, 128), (128, 256), (4,), (4,)), (64, 128, 8, 4),
                                          (32, 256, 4, 3), (32, 256, 4, 6), (64, 128, 4, 6)]:  # fmt: skip
                cand = (bm, bn, bk, warps, stages)
                settings(cand, gm) if kind == "swiglu" else settings(sw, cand)
                try:
                    us = {T: time_us(T, True) for T in (1, 64)}
                except Exception as e:  # noqa: BLE001 (a setting that does not compile or fit is skipped)
                    print(f"| {kind} {cand} | failed: {type(e).__name__} |")
                    continue
                err = max((us[T][1] - ref[T][1]).abs().max().item() for T in us)
                total = sum(v[0] for v in us.values())
                print(f"| {kind} {cand} | {us[1][0]:.1f} | {us[64][0]:.1f} | {err:.2e} |", flush=True)
                results.append((kind, cand, us[1][0], us[64][0], err))
                if err < 1e-2 and (best is None or total < best[0]):
                    best = (total, cand)
            if kind == "swiglu":
                sw = best[1]
            else:
                gm = best[1]
        print(f"best for BLOCK_M {bm}: swiglu {sw}, gemm {gm}", flush=True)
        results.append(("best", sw, gm))
    bests = [r for r in results if r[0] == "best"]
    pick = min(bests, key=lambda r: (settings(r[1], r[2]), sum(time_us(T, True)[0] for T in (1, 64)))[1])
    settings(pick[1], pick[2])
    print(f"picked: swiglu {pick[1]}, gemm {pick[2]}")
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"small_swiglu": pick[1], "small_gemm": pick[2]}, f)
print(
    f"\nsmall_swiglu {tri._TABLE[fam]['small_swiglu']}, small_gemm {tri._TABLE[fam]['small_gemm']}; {a.layers} layers"
)
print("| batch | rows | training settings us | small settings us | speedup | floor us | small GB/s | max diff |")
print("| --- | --- | --- | --- | --- | --- | --- | --- |")
for T in batches:
    us, y = time_us(T, True)
    ids = inputs(T)[1]
    gbs = ids.unique().numel() * per_expert / us / 1e3
    print(
        f"| {T} | {T * K} | {ref[T][0]:.1f} | {us:.1f} | {ref[T][0] / us:.2f}x | {floor_us(T):.1f} | {gbs:,.0f} | "
        f"{(y - ref[T][1]).abs().max().item():.2e} |",
        flush=True,
    )
