"""The 4-bit (NF4) dequantizing GEMMs one by one at the `16B` shapes: each lookup form of the fused dequantization
(`kernels/triton/quant4_dq.py`), the legacy element-wise one, the bf16 kernel on the dequantized weight (the
ceiling) and a dequantize-to-bf16 pre-pass followed by that kernel, in one process on the same inputs.

    python benchmarks/quant4_gemm.py [--tokens 4096] [--reps 20] [--modes legacy,select,gather]
                                     [--tiles 128x256x64w8s3,...] [--tiny]

Dense: x [T, in] @ dq(W)^T (fwd) and g [T, out] @ dq(W) (dgrad, the input gradient) for every 4-bit linear of a
16B layer (attention's q, kv_a, kv_b, o; the dense MLP's gate|up and down; the shared experts' gate|up and down).
Routed experts (64 experts, top-6, D 2048 <-> I 1408): the four grouped GEMMs the training step runs (without the
LoRA terms, which are the same in every variant): gate|up with the SwiGLU epilogue (gathered rows, h saved), down
(scattered), the backward's dSwiGLU GEMM over down and its dx GEMM over gate|up. Each row: median ms of --reps
(CUDA events after warm-up), TFLOP/s, the largest error against an fp32 GEMM over the dequantized weight
(PyTorch), and `ok` where that error is within 2x of PyTorch's bf16 GEMM's. A variant that fails prints its error
in its row; the rest still run. Tables to stdout and to $OUT/quant4_gemm.md when OUT is set.

--tiny: small shapes, for checking that the script runs (on a CPU: under TRITON_INTERPRET=1, fp16 instead of bf16).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

import torch

MODE_NAMES = ("legacy", "select", "gather")


# ---------------------------------------------------------------- timing and rows


def median_ms(fn, reps: int) -> float:
    """Median wall time of fn() in ms after min(3, reps) warm-up calls: CUDA events per call on a GPU, perf_counter
    in the interpreter."""
    for _ in range(min(3, reps)):
        fn()
    times = []
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        for _ in range(reps):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
    else:
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def _err(a: torch.Tensor, ref: torch.Tensor) -> float:
    return float((a.float() - ref).abs().max())


def row(gemm: str, variant: str, flops: float, run, ref: torch.Tensor | None, err_pt: float, reps: int,
        extra_ms: float = 0.0, note: str = "") -> dict:  # fmt: skip
    """One table row: run() -> the output to check against ref (fp32), timed; extra_ms (a pre-pass) added."""
    try:
        out = run()
        err = _err(out, ref) if ref is not None else float("nan")
        ms = median_ms(run, reps) + extra_ms
        ok = err <= 2 * err_pt + 1e-6
        return {"gemm": gemm, "variant": variant, "ms": ms, "tflops": flops / ms / 1e9, "err": err, "ok": ok,
                "note": note}  # fmt: skip
    except Exception as e:  # noqa: BLE001 - one failing variant must not stop the others
        return {"gemm": gemm, "variant": variant, "error": f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"}


def table(rows: list[dict]) -> str:
    lines = ["| GEMM | variant | ms | TFLOP/s | max err vs fp32 | within 2x bf16 | note |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['gemm']} | {r['variant']} | failed | | | | {r['error']} |")
        else:
            lines.append(f"| {r['gemm']} | {r['variant']} | {r['ms']:.3f} | {r['tflops']:.1f} | {r['err']:.3e} | "
                         f"{'ok' if r['ok'] else 'NO'} | {r['note']} |")  # fmt: skip
    return "\n".join(lines)


def summary(rows: list[dict]) -> str:
    """Per GEMM: legacy, the fastest fused form, the bf16 ceiling and the pre-pass route, in ms."""
    head = ("| GEMM | legacy ms | best fused (form) ms | bf16 ceiling ms | dequant + bf16 ms | fused / ceiling | "
            "legacy / best |")
    lines = [head, "|---|---|---|---|---|---|---|"]
    for gemm in dict.fromkeys(r["gemm"] for r in rows):
        mine = {r["variant"]: r["ms"] for r in rows if r["gemm"] == gemm and "ms" in r}
        fused = {v: ms for v, ms in mine.items() if v.startswith("fused")}
        best = min(fused, key=fused.get) if fused else None
        legacy, ceil, pre = mine.get("legacy"), mine.get("bf16 ceiling"), mine.get("dequant + bf16")

        def f(x):
            return f"{x:.3f}" if x is not None else "-"

        ratio = f"{ceil / fused[best]:.2f}x" if best and ceil else "-"
        speedup = f"{legacy / fused[best]:.1f}x" if best and legacy else "-"
        lines.append(f"| {gemm} | {f(legacy)} | {f(fused.get(best))} ({best}) | {f(ceil)} | {f(pre)} | {ratio} | "
                     f"{speedup} |")  # fmt: skip
    return "\n".join(lines)


# ---------------------------------------------------------------- dense


def dense_shapes(tiny: bool) -> list[tuple[str, int, int]]:
    """(name, out, in) of the 4-bit linears of a 16B layer."""
    if tiny:
        return [("q", 96, 128), ("o", 128, 64), ("mlp down", 128, 192)]
    from anyseek.model.config import ModelConfig

    mc = ModelConfig.from_name("16B")
    H, D = mc.num_attention_heads, mc.hidden_size
    qk = mc.qk_nope_head_dim + mc.qk_rope_head_dim
    shared = mc.moe_intermediate_size * mc.n_shared_experts
    return [("q", H * qk, D), ("kv_a", mc.kv_lora_rank + mc.qk_rope_head_dim, D),
            ("kv_b", H * (mc.qk_nope_head_dim + mc.v_head_dim), mc.kv_lora_rank), ("o", D, H * mc.v_head_dim),
            ("mlp gate|up", 2 * mc.intermediate_size, D), ("mlp down", D, mc.intermediate_size),
            ("shared gate|up", 2 * shared, D), ("shared down", D, shared)]  # fmt: skip


def dense_rows(T: int, dev, dt, modes, tiles, reps: int, tiny: bool) -> list[dict]:
    from anyseek.kernels.reference import quant4 as ref4

    g = torch.Generator(device=dev).manual_seed(0)
    rows = []
    for name, out_f, in_f in dense_shapes(tiny):
        W = ref4.quantize4(torch.randn(out_f, in_f, device=dev, generator=g) * 0.02)
        for fwd in (True, False):
            a = torch.randn(T, in_f if fwd else out_f, device=dev, generator=g).to(dt)
            rows += _dense_gemm(f"{name} {'fwd' if fwd else 'dgrad'} [{out_f}x{in_f}]", a, W, fwd, modes, tiles, reps)
    return rows


def _dense_gemm(gemm: str, a: torch.Tensor, W: torch.Tensor, fwd: bool, modes, tiles, reps: int) -> list[dict]:
    """Every variant of a @ dq(W)^T (fwd) or a @ dq(W) (dgrad)."""
    from anyseek.kernels.reference import quant4 as ref4
    from anyseek.kernels.triton import quant4_dq, quant4_linear

    W32 = ref4.dequantize4(W)
    Wb = W32.to(a.dtype)
    ref = a.float() @ (W32.t() if fwd else W32)
    err_pt = _err(a @ (Wb.t() if fwd else Wb), ref)
    flops = 2.0 * a.shape[0] * W32.numel()
    mm = quant4_linear.matmul_wt if fwd else quant4_linear.matmul_w
    rows = []
    for m in modes:
        label = "legacy" if m == "legacy" else f"fused {m}"
        rows.append(row(gemm, label, flops, lambda m=m: mm(a, W, dq=quant4_dq.MODES[m]), ref, err_pt, reps))
    first = next((m for m in modes if m != "legacy"), "gather")
    for tile in tiles:
        rows.append(row(gemm, f"fused {first} {tile_name(tile)}", flops,
                        lambda t=tile: mm(a, W, dq=quant4_dq.MODES[first], tile=t), ref, err_pt, reps))  # fmt: skip
    rows.append(row(gemm, "bf16 ceiling", flops, lambda: a @ (Wb.t() if fwd else Wb), ref, err_pt, reps,
                    note="torch.matmul"))  # fmt: skip
    rows += prepass_rows(gemm, flops, W, lambda w: a @ (w.t() if fwd else w), ref, err_pt, a.dtype, reps)
    return rows


def prepass_rows(gemm, flops, W, gemm_fn, ref, err_pt, dt, reps) -> list[dict]:
    """The dequantize-to-bf16 pre-pass (Triton, one pass) then the bf16 GEMM: the sum, its parts in the note."""
    from anyseek.kernels.triton import quant4_dq

    try:
        dq_ms = median_ms(lambda: quant4_dq.dequantize(W, dt), reps)
        Wd = quant4_dq.dequantize(W, dt)
        r = row(gemm, "dequant + bf16", flops, lambda: gemm_fn(Wd), ref, err_pt, reps, extra_ms=dq_ms)
        if "ms" in r:
            r["note"] = f"dequant {dq_ms:.3f} + GEMM {r['ms'] - dq_ms:.3f} ms; {Wd.numel() * Wd.element_size() / 2**20:.1f} MiB"
        return [r]
    except Exception as e:  # noqa: BLE001
        return [{"gemm": gemm, "variant": "dequant + bf16", "error": f"{type(e).__name__}: {str(e)[:160]}"}]


def tile_name(t) -> str:
    return f"{t[0]}x{t[1]}x{t[2]}w{t[3]}s{t[4]}"


def parse_tile(s: str) -> tuple[int, ...]:
    """'128x256x64w8s3' -> (128, 256, 64, 8, 3)."""
    dims, rest = s.split("w")
    warps, stages = rest.split("s")
    return (*(int(d) for d in dims.split("x")), int(warps), int(stages))


# ---------------------------------------------------------------- routed experts


def expert_rows(T: int, dev, dt, modes, reps: int, tiny: bool) -> list[dict]:
    """The routed experts' four grouped GEMMs (moe.py's launches), each variant on the same plan and inputs."""
    from anyseek.kernels.reference import quant4 as ref4
    from anyseek.kernels.triton import moe
    from anyseek.kernels.triton.moe_plan import build_plan

    E, K, D, I = (4, 2, 64, 64) if tiny else (64, 6, 2048, 1408)
    F = 2 * I
    g = torch.Generator(device=dev).manual_seed(1)
    gu, dn = (ref4.quantize4(torch.randn(E, n, k, device=dev, generator=g) * 0.02) for n, k in ((F, D), (D, I)))
    gu32, dn32 = ref4.dequantize4(gu), ref4.dequantize4(dn)
    x = torch.randn(T, D, device=dev, generator=g).to(dt)
    ids = torch.rand(T, E, device=dev, generator=g).topk(K, dim=1).indices
    w = torch.rand(T * K, device=dev, generator=g)
    plan = build_plan(ids, E, moe._config(dev, "gemm")["BLOCK_M"])
    M = T * K
    dy = torch.randn(T, D, device=dev, generator=g).to(dt)
    dh_in = (torch.randn(M, F, device=dev, generator=g) * 0.1).to(dt)
    h = torch.empty(M, F, device=dev, dtype=dt)
    act_in = torch.empty(M, I, device=dev, dtype=dt)
    moe._gemm(x, gu32.to(dt), moe._nk(gu32), act_in, plan, I, D, moe._config(dev, "swiglu"), gather=True,
              epi=moe.EPI_SWIGLU, h=h, w=w, save_h=True, up_cols=I)  # fmt: skip (h, act: the backward's inputs)
    truth = _ExpertTruth(plan, x, w, h, act_in, dy, dh_in, E)

    def launch(kind, gu_w, dn_w, dt_out=dt):
        out = {"swiglu": (M, I), "down": (M, D), "dswiglu": (M, F), "dx": (M, D)}[kind]
        c = torch.empty(*out, device=dev, dtype=dt_out)
        if kind == "swiglu":
            hh = torch.empty(M, F, device=dev, dtype=dt)
            moe._gemm(x, gu_w, moe._nk(gu_w), c, plan, I, D, moe._config(dev, "swiglu"), gather=True,
                      epi=moe.EPI_SWIGLU, h=hh, w=w, save_h=True, up_cols=I)  # fmt: skip
        elif kind == "down":
            moe._gemm(act_in, dn_w, moe._nk(dn_w), c, plan, D, I, moe._config(dev, "gemm"), scatter=True)
        elif kind == "dswiglu":
            cfg = moe._config(dev, "dswiglu")
            parts = torch.zeros(M, -(-I // cfg["BLOCK_N"]), device=dev, dtype=torch.float32)
            moe._gemm(dy, dn_w, moe._kn(dn_w), c, plan, I, D, cfg, gather=True, epi=moe.EPI_DSWIGLU, h=h, w=w,
                      dw=parts, up_cols=I)  # fmt: skip
        else:
            moe._gemm(dh_in, gu_w, moe._kn(gu_w), c, plan, D, F, moe._config(dev, "gemm"), scatter=True)
        return c

    gemms = [("experts gate|up+SwiGLU fwd", "swiglu", 2.0 * M * D * F), ("experts down fwd", "down", 2.0 * M * I * D),
             ("experts dSwiGLU (dgrad of down)", "dswiglu", 2.0 * M * D * I),
             ("experts dx (dgrad of gate|up)", "dx", 2.0 * M * F * D)]  # fmt: skip
    rows = []
    gu_b, dn_b = gu32.to(dt), dn32.to(dt)
    for gemm, kind, flops in gemms:
        ref = truth.output(kind, gu32, dn32)
        err_pt = _err(truth.output(kind, gu_b, dn_b), ref)
        for m in modes:
            label = "legacy" if m == "legacy" else f"fused {m}"
            rows.append(row(gemm, label, flops, lambda m=m, k=kind: _with_mode(m, lambda: launch(k, gu, dn)), ref,
                            err_pt, reps))  # fmt: skip
        rows.append(row(gemm, "bf16 ceiling", flops, lambda k=kind: launch(k, gu_b, dn_b), ref, err_pt, reps,
                        note="the same grouped kernel, bf16 stacks"))  # fmt: skip
        stack = gu if kind in ("swiglu", "dx") else dn
        rows.extend(prepass_rows(gemm, flops, stack, lambda s, k=kind: launch(k, s, s), ref, err_pt, dt, reps))
    return rows


def _with_mode(name: str, fn):
    """fn() with ANYSEEK_QUANT4_DQ=name (moe.py's launcher reads the form at each launch)."""
    old = os.environ.get("ANYSEEK_QUANT4_DQ")
    os.environ["ANYSEEK_QUANT4_DQ"] = name
    try:
        return fn()
    finally:
        if old is None:
            del os.environ["ANYSEEK_QUANT4_DQ"]
        else:
            os.environ["ANYSEEK_QUANT4_DQ"] = old


class _ExpertTruth:
    """The four grouped GEMMs' outputs in PyTorch, expert by expert, for given (dequantized) stacks in their dtype:
    in fp32 the reference, in bf16 PyTorch's own error."""

    def __init__(self, plan, x, w, h, act, dy, dh, E):
        slot, tok, offs = (t.long() for t in plan[:3])
        self.slot, self.tok, self.offs, self.E = slot, tok, offs.tolist(), E
        self.x, self.w, self.h, self.act, self.dy, self.dh = x, w, h, act, dy, dh

    def output(self, kind: str, gu: torch.Tensor, dn: torch.Tensor) -> torch.Tensor:
        dt = gu.dtype
        M = self.slot.numel()
        cols = {"swiglu": dn.shape[2], "down": dn.shape[1], "dswiglu": gu.shape[1], "dx": gu.shape[2]}[kind]
        out = torch.zeros(M, cols, device=gu.device, dtype=torch.float32)
        for e in range(self.E):
            r = slice(self.offs[e], self.offs[e + 1])
            if r.start == r.stop:
                continue
            tok, slot = self.tok[r], self.slot[r]
            if kind == "swiglu":
                hh = (self.x[tok].to(dt) @ gu[e].t()).float()
                I = hh.shape[1] // 2
                out[r] = torch.nn.functional.silu(hh[:, :I]) * hh[:, I:] * self.w[slot, None]
            elif kind == "down":
                out[slot] = (self.act[r].to(dt) @ dn[e].t()).float()
            elif kind == "dswiglu":
                d_act = (self.dy[tok].to(dt) @ dn[e]).float() * self.w[slot, None]
                I = d_act.shape[1]
                g_, u = self.h[r, :I].float(), self.h[r, I:].float()
                sig = torch.sigmoid(g_)
                out[r] = torch.cat([d_act * u * sig * (1 + g_ * (1 - sig)), d_act * g_ * sig], 1)
            else:
                out[slot] = (self.dh[r].to(dt) @ gu[e]).float()
        return out


# ---------------------------------------------------------------- main


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--modes", default=",".join(MODE_NAMES), help="lookup forms to time (legacy: the old kernel)")
    ap.add_argument("--tiles", default="128x256x64w8s3,256x128x64w8s3",
                    help="extra dense tiles (BMxBNxBKwWARPSsSTAGES) for the first fused form; '' for none")
    ap.add_argument("--skip-dense", action="store_true")
    ap.add_argument("--skip-experts", action="store_true")
    ap.add_argument("--tiny", action="store_true", help="small shapes: checks that the script runs (CPU: interpreter)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        if not args.tiny:
            raise SystemExit("no GPU: run with --tiny (the Triton interpreter, small shapes)")
        os.environ.setdefault("TRITON_INTERPRET", "1")  # (before the kernels' modules import triton)
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dt = torch.bfloat16 if dev.type == "cuda" else torch.float16  # (the interpreter has no bf16 loads)
    T = min(args.tokens, 24) if args.tiny else args.tokens
    reps = 1 if args.tiny and dev.type == "cpu" else args.reps
    modes = [m for m in args.modes.split(",") if m]
    bad = [m for m in modes if m not in MODE_NAMES]
    if bad:
        raise SystemExit(f"--modes: unknown {bad}; choose from {', '.join(MODE_NAMES)}")
    tiles = [] if args.tiny or not args.tiles else [parse_tile(s) for s in args.tiles.split(",")]
    name = torch.cuda.get_device_name() if dev.type == "cuda" else "CPU (Triton interpreter)"
    head = f"{name} | torch {torch.__version__} | {T} tokens | {dt} | median of {reps}"
    parts = [f"# 4-bit GEMMs\n\n{head}\n"]
    rows = []
    if not args.skip_dense:
        dense = dense_rows(T, dev, dt, modes, tiles, reps, args.tiny)
        rows += dense
        parts.append("## Dense linears\n\n" + table(dense))
        print(parts[-1] + "\n", flush=True)
    if not args.skip_experts:
        experts = expert_rows(T, dev, dt, modes, reps, args.tiny)
        rows += experts
        parts.append("## Routed experts\n\n" + table(experts))
        print(parts[-1] + "\n", flush=True)
    parts.append("## Summary\n\n" + summary(rows))
    print(parts[-1])
    if os.environ.get("OUT"):
        path = Path(os.environ["OUT"]) / "quant4_gemm.md"
        tmp = path.with_suffix(".md.tmp")
        tmp.write_text("\n\n".join(parts) + "\n")
        tmp.replace(path)
        print(f"written: {path}")


if __name__ == "__main__":
    main()
