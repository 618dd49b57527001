"""Routed experts (permute + grouped SwiGLU experts + combine) on one GPU: correctness, launch settings, peers.

    python benchmarks/moe.py --check      # worst error ratios vs the fp32 reference (2x rule), bf16 and fp16
    python benchmarks/moe.py --tune       # the triton backend under several launch settings (16B, 671B shapes)
    python benchmarks/moe.py --bench      # forward and forward+backward: triton, torch._grouped_mm, loop, reference
    python benchmarks/moe.py --lora       # LoRA experts (frozen base, rank-r adapters) vs full fine-tuning's experts
    python benchmarks/moe.py --kernels    # each of the six grouped GEMMs alone vs cuBLAS bmm on equal expert blocks
    --out DIR writes check.md / tune.md / bench.md / lora.md / kernels.md there as well as printing them.

Shapes (E experts, I expert width, K experts per token, D hidden): small 32/512/4/1024, 16B (Moonlight)
64/1408/6/2048, 671B (DeepSeek-V3, one layer) 256/2048/8/7168; balanced routing (K distinct experts drawn
uniformly per token) and skewed routing (expert popularity ~ 1/rank, `accuracy.moe_routing`). Peers, each given
the same bf16 inputs and fp32 routing weights:
  grouped_mm  anyseek's torch._grouped_mm backend (CUTLASS grouped GEMM on sm_90/sm_100, bf16 only);
  loop        what torch._grouped_mm does on every other GPU (sm_80/86/89/120): offsets copied to the host, one
              matmul per expert (written as PyTorch's fallback does), autograd through it;
  reference   anyseek's pure-PyTorch reference (also a per-expert loop, routing weight on the activation).
TFLOP/s count the routed matmuls only: forward 6*M*D*I (M = T*K), forward+backward 18*M*D*I. Times are medians
of triton.testing.do_bench (CUDA events), random non-zero inputs.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from datetime import datetime, timezone

import torch
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "src"))

import itertools

from anyseek.kernels import accuracy, torch_backends
from anyseek.kernels.reference import moe as ref_moe

SHAPES = {  # name: (E, I, K, D)
    "small": (32, 512, 4, 1024),
    "16B": (64, 1408, 6, 2048),
    "671B": (256, 2048, 8, 7168),
}
TOKENS = {"small": (8192, 32768), "16B": (8192, 32768), "671B": (8192, 16384)}


def env_line() -> str:
    import triton

    p = torch.cuda.get_device_properties(0)
    return (
        f"{p.name} ({p.multi_processor_count} SMs), PyTorch {torch.__version__}, Triton {triton.__version__}, "
        f"{platform.system()}, {datetime.now(timezone.utc).strftime('%Y-%m-%d %H:%M UTC')}"
    )


def emit(lines: list[str], out_dir: str | None, name: str) -> None:
    text = "\n".join(lines)
    print(text, flush=True)
    if out_dir:
        with open(os.path.join(out_dir, name), "w") as f:
            f.write(text + "\n")


# ----------------------------------------------------------------------------------------------------------------
# peers


def _loop_mm(a_MK: torch.Tensor, b_EKN: torch.Tensor, offs_E: torch.Tensor) -> torch.Tensor:
    """torch._grouped_mm as PyTorch computes it without the fused kernel: offsets to the host, a matmul per group."""
    bounds = [0] + offs_E.tolist()  # host sync
    # split/unbind, not a[s:e] / b[g]: each slice's backward would build a full-size gradient (E of them), which
    # PyTorch's fallback (its backward is _grouped_mm again, looping into one output) does not do
    a_parts, b_KN = a_MK.split([e - s for s, e in itertools.pairwise(bounds)]), b_EKN.unbind(0)
    outs = [a @ b for a, b in zip(a_parts, b_KN)]
    return torch.cat(outs)


def loop_routed_experts(x_TD, topk_ids_TK, topk_weights_TK, gate_up_EFD, down_EDI):
    """grouped_mm_routed_experts with torch._grouped_mm replaced by its per-expert fallback."""
    E, I = gate_up_EFD.shape[0], down_EDI.shape[-1]
    x_MD, order_M, counts_E = ref_moe.permute(x_TD, topk_ids_TK, E)
    offs_E = counts_E.cumsum(0)
    h_MF = _loop_mm(x_MD, gate_up_EFD.transpose(1, 2), offs_E)
    act_MI = F.silu(h_MF[:, :I]) * h_MF[:, I:]
    y_MD = _loop_mm(act_MI, down_EDI.transpose(1, 2), offs_E)
    return ref_moe.unpermute(y_MD, order_M, topk_weights_TK).to(x_TD.dtype)


def backends() -> dict:
    from anyseek.kernels.ops import moe

    fns = {"triton": moe.routed_experts}
    ok, _ = torch_backends.grouped_mm_available(torch.empty(1, device="cuda", dtype=torch.bfloat16))
    if ok:
        fns["grouped_mm"] = torch_backends.grouped_mm_routed_experts
    fns["loop"] = loop_routed_experts
    fns["reference"] = ref_moe.routed_experts
    return fns


# ----------------------------------------------------------------------------------------------------------------
# timing


def make(shape: str, T: int, routing: str, seed: int = 0):
    E, I, K, D = SHAPES[shape]
    g = torch.Generator().manual_seed(seed)
    ids = accuracy.moe_routing(T, E, K, routing, g).cuda()
    x = torch.randn(T, D, device="cuda", dtype=torch.bfloat16)
    w = (torch.rand(T, K, device="cuda") + 0.1) / K
    gu = (torch.randn(E, 2 * I, D, device="cuda", dtype=torch.bfloat16) / D**0.5).requires_grad_()
    dn = (torch.randn(E, D, I, device="cuda", dtype=torch.bfloat16) / I**0.5).requires_grad_()
    return x.requires_grad_(), ids, w.requires_grad_(), gu, dn, torch.randn(T, D, device="cuda", dtype=torch.bfloat16)


def time_ms(fn, inputs, backward: bool, rep: int = 120, graph: bool = False) -> float:
    """Median ms of the op (forward, or forward + backward). graph: replayed as one CUDA graph, as the trainer runs
    it (no host launch overhead: what counts at small shapes, where eager launches outlast the kernels)."""
    import triton

    x, ids, w, gu, dn, dy = inputs
    leaves = [x, w, gu, dn]

    def step():
        y = fn(x, ids, w, gu, dn)
        if backward:
            torch.autograd.grad(y, leaves, dy)

    if graph:
        step()  # compile outside the capture
        torch.cuda.synchronize()
        return triton.testing.do_bench_cudagraph(step, rep=rep, return_mode="median")

    if not backward:
        with torch.no_grad():
            return triton.testing.do_bench(step, warmup=25, rep=rep, return_mode="median")
    return triton.testing.do_bench(step, warmup=25, rep=rep, return_mode="median")


def flops(shape: str, T: int, backward: bool) -> float:
    _E, I, K, D = SHAPES[shape]
    return (18 if backward else 6) * T * K * D * I


def bench(out_dir: str | None, shapes: list[str], tokens: dict) -> list[dict]:
    fns = backends()
    rows = []
    lines = [f"Routed experts, {env_line()}", "",
             "| shape | tokens | routing | mode | " + " | ".join(f"{n} ms (TFLOP/s)" for n in fns) +
             " | triton vs grouped_mm | triton vs loop |",
             "|" + "---|" * (6 + len(fns))]  # fmt: skip
    for shape in shapes:
        for T in tokens[shape]:
            for routing in ("balanced", "skewed"):
                inputs = make(shape, T, routing)
                for backward in (False, True):
                    times = {}
                    for name, fn in fns.items():
                        try:
                            times[name] = time_ms(fn, inputs, backward, rep=60 if name in ("loop", "reference") else 120)
                        except torch.OutOfMemoryError:
                            times[name] = float("nan")
                        torch.cuda.empty_cache()
                    fl = flops(shape, T, backward)
                    cells = [f"{t:.2f} ({fl / t / 1e9:.0f})" for t in times.values()]
                    vs_g = times.get("grouped_mm", float("nan")) / times["triton"]
                    vs_l = times["loop"] / times["triton"]
                    what = "fwd+bwd" if backward else "fwd"
                    lines.append(f"| {shape} | {T} | {routing} | {what} | " + " | ".join(cells) +
                                 f" | {vs_g:.2f}x | {vs_l:.2f}x |")  # fmt: skip
                    print(lines[-1], flush=True)
                    rows.append(dict(shape=shape, T=T, routing=routing, backward=backward, **times))
                del inputs
                torch.cuda.empty_cache()
    emit(lines, out_dir, "bench.md")
    return rows


def lora(out_dir: str | None, shapes: list[str], rank: int = 16) -> None:
    """Forward + backward of one MoE layer's routed experts as fine-tuning runs them, CUDA-graph replay:
    full        the Triton experts, gradients for x, the routing weights and both weight stacks;
    lora        frozen base, per-expert adapters inside the Triton GEMMs (`lora_routed_experts`, the default);
    old wgrad   the same with the rank-r weight gradients' settings before stop 33 (64-row steps, 4 warps, 4 row
                chunks per expert);
    merged      the effective weights W + s B A formed each call (torch.baddbmm) and handed to the same Triton
                experts (what lora_routed_experts' other backends do, on their own experts): [E, F, D] gradients
                reduced to the adapters'."""
    from anyseek.kernels.ops import moe
    from anyseek.kernels.triton import moe_lora

    lines = [f"LoRA routed experts, rank {rank}, fwd+bwd as one CUDA graph, {env_line()}", "",
             "| shape | tokens | routing | full ms | lora ms | lora vs full | old wgrad | merged ms |",
             "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for shape in shapes:
        E, I, K, D = SHAPES[shape]
        T = 8192
        for routing in ("balanced", "skewed"):
            x, ids, w, gu, dn, dy = make(shape, T, routing)
            g = torch.Generator(device="cuda").manual_seed(1)
            ad = [(torch.randn(*sh, device="cuda", generator=g, dtype=torch.bfloat16) * 0.02).requires_grad_()
                  for sh in ((E, rank, D), (E, 2 * I, rank), (E, rank, I), (E, D, rank))]  # fmt: skip
            base = (gu.detach(), dn.detach())

            def run(kind):
                def step():
                    if kind == "full":
                        y = moe.routed_experts(x, ids, w, gu, dn)
                        torch.autograd.grad(y, [x, w, gu, dn], dy)
                    elif kind == "merged":
                        egu = torch.baddbmm(base[0], ad[1], ad[0], alpha=2.0)
                        edn = torch.baddbmm(base[1], ad[3], ad[2], alpha=2.0)
                        torch.autograd.grad(moe.routed_experts(x, ids, w, egu, edn), [x, w, *ad], dy)
                    else:
                        y = moe.lora_routed_experts(x, ids, w, *base, *ad, 2.0)
                        torch.autograd.grad(y, [x, w, *ad], dy)

                import triton

                step()
                torch.cuda.synchronize()
                return triton.testing.do_bench_cudagraph(step, rep=100, return_mode="median")

            t = {k: run(k) for k in ("full", "lora", "merged")}
            table = dict(moe_lora._RANK_TABLE)
            moe_lora._RANK_TABLE.update({k: (64, 4, 4, 4) for k in table})
            t["old"] = run("lora")
            moe_lora._RANK_TABLE.update(table)
            lines.append(f"| {shape} | {T} | {routing} | {t['full']:.3f} | {t['lora']:.3f} | "
                         f"{t['full'] / t['lora']:.2f}x | {t['old']:.3f} | {t['merged']:.3f} |")
            print(lines[-1], flush=True)
            torch.cuda.empty_cache()
    emit(lines, out_dir, "lora.md")


# ----------------------------------------------------------------------------------------------------------------
# correctness


def check(out_dir: str | None) -> bool:
    from anyseek.kernels.ops import moe

    cases = [  # (T, D, I, E, K, routing)
        (4096, 1024, 512, 32, 4, "balanced"), (4096, 1024, 512, 32, 4, "skewed"),
        (2000, 2048, 1408, 64, 6, "skewed"), (1536, 7168, 2048, 32, 8, "balanced"),
        (999, 200, 136, 16, 3, "sparse"), (513, 256, 96, 8, 1, "one_expert"), (1, 512, 256, 16, 8, "balanced"),
    ]  # fmt: skip
    lines = [f"Routed experts correctness, {env_line()}", "", "| case | dtype | pass | worst err/pt | errors |",
             "|---|---|---|---|---|"]  # fmt: skip
    ok = True
    for T, D, I, E, K, routing in cases:
        inputs = accuracy.moe_inputs(T, D, I, E, K, routing, seed=T)
        for dtype in (torch.bfloat16, torch.float16):
            table = accuracy.moe_error_table(moe.routed_experts, inputs, dtype, "cuda")
            good = accuracy.passes(table, dtype)
            ok &= good
            errs = " ".join(f"{n} {e:.1e}/{p:.1e}" for n, e, p in table)
            lines.append(f"| T={T} D={D} I={I} E={E} K={K} {routing} | {str(dtype)[6:]} | {'PASS' if good else 'FAIL'}"
                         f" | {accuracy.worst_ratio(table):.2f} | {errs} |")  # fmt: skip
            print(lines[-1], flush=True)
        torch.cuda.empty_cache()
    emit(lines, out_dir, "check.md")
    return ok


# ----------------------------------------------------------------------------------------------------------------
# launch settings


ROW_TILED = ("gemm", "swiglu", "dswiglu", "lora_dx")  # the grouped GEMMs that read the plan's row tiles
TUNE = {
    "swiglu": [(128, 64, 64, 8, 4), (128, 64, 64, 8, 3), (128, 128, 64, 8, 3), (64, 128, 64, 4, 4), (128, 64, 64, 4, 4),
               (64, 64, 64, 4, 4), (128, 128, 64, 8, 4)],
    "gemm": [(128, 128, 64, 8, 4), (128, 128, 64, 8, 3), (128, 256, 64, 8, 3), (128, 128, 64, 4, 4),
             (64, 128, 64, 4, 4), (128, 64, 64, 4, 4), (64, 64, 64, 4, 4)],
    "dswiglu": [(128, 128, 64, 16, 4), (128, 128, 64, 16, 3), (128, 64, 64, 8, 4), (128, 128, 64, 8, 4),
                (128, 64, 64, 16, 4)],
    "wgrad": [(128, 128, 64, 8, 4), (128, 128, 64, 8, 3), (128, 256, 64, 8, 3), (256, 128, 64, 8, 3),
              (128, 128, 32, 8, 4), (128, 128, 64, 4, 4), (64, 128, 64, 4, 4), (128, 64, 64, 4, 4),
              (64, 64, 64, 4, 4)],
}  # fmt: skip


def tune(out_dir: str | None, cases_arg: str = "16B:16384,671B:16384", graph: bool = False) -> None:
    from anyseek.kernels.ops import moe as moe_ops
    from anyseek.kernels.triton import moe

    row = moe.family(torch.device("cuda"))
    base = dict(moe._TABLE[row])
    cases = [(c.split(":")[0], int(c.split(":")[1]), "balanced") for c in cases_arg.split(",")]
    how = "one CUDA graph per call" if graph else "eager"
    lines = [f"Launch settings (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages), fwd+bwd ms ({how}), {env_line()}", "",
             "| kernel | setting | " + " | ".join(f"{s} {t // 1024}k balanced" for s, t, _ in cases) + " |",
             "|---|---|" + "---|" * len(cases)]
    inputs = {c: make(*c) for c in cases}
    for kind, settings in TUNE.items():
        for s in settings:
            table = dict(base, **{kind: s})
            if kind in ROW_TILED:  # one BLOCK_M for these (the routing plan's row tiles)
                table.update({other: (s[0],) + base[other][1:] for other in ROW_TILED if other != kind})
            moe._TABLE[row] = table
            cells = []
            for c in cases:
                try:
                    cells.append(f"{time_ms(moe_ops.routed_experts, inputs[c], True, rep=250, graph=graph):.3f}")
                except Exception as e:  # noqa: BLE001 - a sweep: report and go on
                    cells.append(type(e).__name__)
            lines.append(f"| {kind} | {s} | " + " | ".join(cells) + " |")
            print(lines[-1], flush=True)
    moe._TABLE[row] = base
    emit(lines, out_dir, "tune.md")

# ----------------------------------------------------------------------------------------------------------------
# each grouped GEMM alone


KERNELS = ("swiglu", "down", "dswiglu", "dx", "wgrad_gu", "wgrad_dn")


def kernels(out_dir: str | None, cases_arg: str = "small:32768") -> None:
    """The six grouped GEMMs of one MoE layer's forward and backward, each alone at its shipped launch settings
    (balanced routing), against cuBLAS `bmm` over equal expert blocks of the same FLOPs (the ceiling a grouped GEMM
    could reach): where the experts' time goes, kernel by kernel."""
    import triton

    from anyseek.kernels.triton import moe, moe_plan

    dev = "cuda"
    lines = [f"Each routed-experts GEMM alone (balanced routing), {env_line()}", "",
             "| shape | tokens | kernel | launch settings | us | TFLOP/s | cuBLAS bmm us | cuBLAS TFLOP/s "
             "| vs cuBLAS |",
             "|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for case in cases_arg.split(","):
        shape, T = case.split(":")[0], int(case.split(":")[1])
        E, I, K, D = SHAPES[shape]
        F_, M, bf = 2 * I, int(T) * K, torch.bfloat16
        x, ids, w, gu, dn, dy = accuracy.moe_inputs(T, D, I, E, K, "balanced", seed=0)
        x, dy, gu, dn, ids = x.to(dev, bf), dy.to(dev, bf), gu.to(dev, bf), dn.to(dev, bf), ids.to(dev)
        w_M = w.to(dev).reshape(-1).float()
        cfg = {k: moe._config(x.device, k) for k in ("swiglu", "gemm", "dswiglu", "wgrad")}
        plan = moe_plan.build_plan(ids, E, cfg["gemm"]["BLOCK_M"])
        act, h = x.new_empty(M, I), x.new_empty(M, F_)
        moe._gemm(x, gu, moe._nk(gu), act, plan, I, D, cfg["swiglu"], gather=True, epi=moe.EPI_SWIGLU, h=h, w=w_M,
                  save_h=True, up_cols=I)  # real pre-activations for the dSwiGLU epilogue
        y_slot, dh, dh_out, dx_slot = x.new_empty(M, D), torch.randn_like(h), torch.empty_like(h), x.new_empty(M, D)
        dw_parts = torch.empty(M, triton.cdiv(I, cfg["dswiglu"]["BLOCK_N"]), device=dev, dtype=torch.float32)
        ddn, dgu = torch.empty_like(dn), torch.empty_like(gu)
        g, sw, ds, wg = cfg["gemm"], cfg["swiglu"], cfg["dswiglu"], cfg["wgrad"]
        run = {
            "swiglu": (sw, lambda: moe._gemm(x, gu, moe._nk(gu), act, plan, I, D, sw, gather=True,
                                             epi=moe.EPI_SWIGLU, h=h, w=w_M, save_h=True, up_cols=I)),
            "down": (g, lambda: moe._gemm(act, dn, moe._nk(dn), y_slot, plan, D, I, g, scatter=True)),
            "dswiglu": (ds, lambda: moe._gemm(dy, dn, moe._kn(dn), dh_out, plan, I, D, ds, gather=True,
                                              epi=moe.EPI_DSWIGLU, h=h, w=w_M, dw=dw_parts, up_cols=I)),
            "dx": (g, lambda: moe._gemm(dh, gu, moe._kn(gu), dx_slot, plan, D, F_, g, scatter=True)),
            "wgrad_gu": (wg, lambda: moe._wgrad(dh, None, x, plan[1], dgu, plan[2], wg)),
            "wgrad_dn": (wg, lambda: moe._wgrad(dy, plan[1], act, None, ddn, plan[2], wg)),
        }  # fmt: skip
        R = M // E  # cuBLAS: E equal blocks of R rows, operands laid out as the grouped GEMM reads them
        a_D, a_I, a_F = (torch.randn(E, R, n, device=dev, dtype=bf) for n in (D, I, F_))
        b_DF, b_ID = torch.randn(E, D, F_, device=dev, dtype=bf), torch.randn(E, I, D, device=dev, dtype=bf)
        ceiling = {"swiglu": (a_D, b_DF), "down": (a_I, b_ID), "dswiglu": (a_D, b_ID.transpose(1, 2)),
                   "dx": (a_F, b_DF.transpose(1, 2)), "wgrad_gu": (a_F.transpose(1, 2), a_D),
                   "wgrad_dn": (a_D.transpose(1, 2), a_I)}  # fmt: skip
        fl = {"swiglu": 2 * M * D * F_, "down": 2 * M * I * D, "dswiglu": 2 * M * D * I, "dx": 2 * M * F_ * D,
              "wgrad_gu": 2 * M * F_ * D, "wgrad_dn": 2 * M * D * I}  # fmt: skip
        for name in KERNELS:
            c, fn = run[name]
            fn()
            t = triton.testing.do_bench(fn, rep=100)
            a, b = ceiling[name]
            tc = triton.testing.do_bench(lambda: torch.bmm(a, b), rep=100)
            setting = (c["BLOCK_M"], c["BLOCK_N"], c["BLOCK_K"], c["num_warps"], c["num_stages"])
            lines.append(f"| {shape} | {T} | {name} | {setting} | {t * 1e3:.0f} | {fl[name] / t / 1e9:.0f} | "
                         f"{tc * 1e3:.0f} | {fl[name] / tc / 1e9:.0f} | {tc / t:.2f}x |")  # fmt: skip
            print(lines[-1], flush=True)
        torch.cuda.empty_cache()
    emit(lines, out_dir, "kernels.md")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--check", action="store_true")
    p.add_argument("--tune", action="store_true")
    p.add_argument("--bench", action="store_true")
    p.add_argument("--lora", action="store_true")
    p.add_argument("--kernels", action="store_true")
    p.add_argument("--kernel-cases", default="small:32768,16B:16384", help="--kernels: SHAPE:TOKENS,...")
    p.add_argument("--shapes", default="small,16B,671B")
    p.add_argument("--tokens", default=None, help="token counts for every shape, comma-separated (default: per shape)")
    p.add_argument("--tune-cases", default="16B:16384,671B:16384", help="--tune: SHAPE:TOKENS,... (balanced)")
    p.add_argument("--graph", action="store_true", help="--tune: time each call as one CUDA graph replay")
    p.add_argument("--out", default=os.environ.get("OUT"))
    args = p.parse_args(argv)
    ok = True
    t0 = time.time()
    if args.check:
        ok = check(args.out)
    if args.tune:
        tune(args.out, args.tune_cases, args.graph)
    if args.bench:
        shapes = args.shapes.split(",")
        tokens = {s: tuple(int(t) for t in args.tokens.split(",")) for s in shapes} if args.tokens else TOKENS
        bench(args.out, shapes, tokens)
    if args.lora:
        lora(args.out, [s for s in args.shapes.split(",") if s != "671B"])
    if args.kernels:
        kernels(args.out, args.kernel_cases)
    print(f"done in {time.time() - t0:.0f} s", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
