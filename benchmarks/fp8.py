"""FP8 training (DeepSeek-V3's recipe, `train.precision = "fp8"`) on one GPU: compile, check, then time.

    python benchmarks/fp8.py                       # everything below, ~3-4 min on one H100
    python benchmarks/fp8.py --only compile        # no GPU needed: the kernels compiled for sm_89, sm_90, sm_120
    python benchmarks/fp8.py --only gemm --flavors small --tokens 8192
    python benchmarks/fp8.py --only check,tune     # the GEMM under other launch settings (not in the default run)
    --out DIR also writes each table to DIR/fp8-<section>.md.

Sections, in order (each prints a markdown table):
  compile  every Triton FP8 kernel compiled (not run) for sm_89 (Ada), sm_90 (Hopper) and sm_120 (consumer
           Blackwell) with `triton.compile(..., target=GPUTarget(...))`: ok or the error, and which MMA the PTX uses.
  check    on this GPU, before any timing: the Triton GEMM within 2x of fp64 on the same quantized operands (beside
           PyTorch's fp32 matmul of the dequantized operands, rounded to the output dtype), for 1x128 and 128x128
           scales, bf16 and fp32 out; `kernels.fp8_linear`'s output and both gradients, Triton against the PyTorch
           twin. A failure stops the script (exit 1).
  gemm     TFLOP/s (2 M N K / time) of each dense linear of the `small` and `16B` flavors at 8192 and 32768 tokens,
           Fprop / Dgrad / Wgrad, the operands already quantized: ours (Triton, promoted every 128 K) against cuBLAS
           bf16 (torch.matmul) and torch._scaled_mm rowwise FP8 (one scale per row / column; cuBLAS's fp32
           accumulation, and its fast accumulation) in the same run, same shapes.
  quant    time of each quantization the linear layer runs (x rows, W blocks + W^T, dy rows, dy^T rows, x^T
           re-tiled from the FP8 copy), in GB/s of bytes read + written.
  tune     (only when asked) the GEMM at three shapes under a few launch settings (tile, warps, stages), for
           choosing `fp8_gemm.CONFIG` (set from no measurement so far).
  grouped  the routed experts' grouped FP8 GEMM (`fp8_grouped.py`) at the `small` and `16B` expert shapes, balanced
           random routing: gate|up with the token rows gathered, down with the rows scattered to token order,
           against anyseek's bf16 Triton grouped GEMM (same plan, gather and scatter, plain epilogue) and
           torch._grouped_mm bf16 on rows permuted beforehand (copy not timed); then the experts' whole forward +
           backward, `kernels.fp8_routed_experts` against the bf16 Triton experts.
  profile  (only when asked) where the time goes: torch.profiler's kernel table (the top kernels by GPU time a
           step, grouped by kernel name) of the routed experts' forward + backward at the --flavors / --tokens
           shapes, FP8 and bf16, then of the training step of --train-flavors in both precisions (eager: kernels
           replayed in a CUDA graph are not all attributed).
  train    `small` (--train-flavors: also e.g. 16B/4, the 16B's shapes cut to 4 decoder layers; --data: the corpus),
           one optimizer step as `anyseek train` runs it (CUDA graphs, working copy), bf16 against
           train.precision=fp8, at 8192 and 32768 tokens: ms/step, tokens/s, peak memory, loss after the steps.
Times: medians of triton.testing.do_bench (CUDA events, L2 flushed) for kernels; mean over timed steps after
warm-up for the training step (each case in a fresh process).
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from functools import partial
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "src"))

from anyseek.kernels.reference import fp8 as ref

SECTIONS = ("compile", "check", "gemm", "quant", "grouped", "train", "tune", "profile")
DEFAULT = ("compile", "check", "gemm", "quant", "grouped", "train")


def linear_shapes(flavor: str) -> list[tuple[str, int, int]]:
    """(layer, N out, K in) of each distinct FP8 linear of a flavor (joined layers as the model joins them)."""
    from anyseek.model.config import ModelConfig

    c = ModelConfig.from_name(flavor)
    H, qk = c.num_attention_heads, c.qk_nope_head_dim + c.qk_rope_head_dim
    kv_a = c.kv_lora_rank + c.qk_rope_head_dim
    out = []
    if c.q_lora_rank:
        out += [("q_a|kv_a", c.q_lora_rank + kv_a, c.hidden_size), ("q_b", H * qk, c.q_lora_rank)]
    else:
        out += [("q_proj", H * qk, c.hidden_size), ("kv_a", kv_a, c.hidden_size)]
    out += [("kv_b", H * (c.qk_nope_head_dim + c.v_head_dim), c.kv_lora_rank),
            ("o_proj", c.hidden_size, H * c.v_head_dim),
            ("dense gate|up", 2 * c.intermediate_size, c.hidden_size),
            ("dense down", c.hidden_size, c.intermediate_size)]
    shared = c.n_shared_experts * c.moe_intermediate_size
    if shared:
        out += [("shared gate|up", 2 * shared, c.hidden_size), ("shared down", c.hidden_size, shared)]
    return out


def table(title: str, head: list[str], rows: list[list], out: Path | None, name: str) -> None:
    lines = [f"### {title}", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(str(x) for x in r) + " |" for r in rows]
    text = "\n".join(lines) + "\n"
    print(text, flush=True)
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        (out / f"fp8-{name}.md").write_text(text)


# ------------------------------------------------------------------------------------------------------- compile


def compile_targets(out: Path | None) -> bool:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from anyseek.kernels.triton import fp8_gemm, fp8_grouped, fp8_quant

    i32 = "i32"
    kernels = {
        "gemm (128x128 blocks, bf16 out)": (fp8_gemm._gemm_kernel, {
            "A": "*fp8e4nv", "SA": "*fp32", "B": "*fp8e4nv", "SB": "*fp32", "C": "*bf16", "M": i32, "N": i32, "K": i32,
            "stride_a": i32, "stride_b": i32, "stride_c": i32, "stride_sa": i32, "stride_sb": i32},
            {"B_BLOCKS": True, "BM": 128, "BN": 128, "BK": 128, "GROUP_M": 8, "SCALED": False, "SCALES_T": True},
            {"num_warps": 8, "num_stages": 4}),
        "gemm (1x128 tiles, fp32 out)": (fp8_gemm._gemm_kernel, {
            "A": "*fp8e4nv", "SA": "*fp32", "B": "*fp8e4nv", "SB": "*fp32", "C": "*fp32", "M": i32, "N": i32, "K": i32,
            "stride_a": i32, "stride_b": i32, "stride_c": i32, "stride_sa": i32, "stride_sb": i32},
            {"B_BLOCKS": False, "BM": 128, "BN": 128, "BK": 128, "GROUP_M": 8, "SCALED": False, "SCALES_T": True},
            {"num_warps": 8, "num_stages": 4}),
        "quantize rows": (fp8_quant._rows_kernel, {
            "X": "*bf16", "Q": "*fp8e4nv", "S": "*fp32", "M": i32, "K": i32, "stride_x": i32, "stride_q": i32,
            "stride_s": i32}, {"BR": fp8_quant.BR, "TILE": 128, "POW2": True}, {"num_warps": 4}),
        "quantize rows_t (re-tiling)": (fp8_quant._cols_t_kernel, {
            "X": "*fp8e4nv", "SX": "*fp32", "QT": "*fp8e4nv", "ST": "*fp32", "M": i32, "K": i32, "stride_x": i32,
            "stride_sx": i32, "stride_qt": i32, "stride_st": i32},
            {"DEQUANT": True, "BC": fp8_quant.BC, "TILE": 128}, {"num_warps": 4}),
        "quantize blocks": (fp8_quant._blocks_kernel, {
            "W": "*fp32", "Q": "*fp8e4nv", "QT": "*fp8e4nv", "S": "*fp32", "N": i32, "K": i32, "stride_w": i32,
            "stride_q": i32, "stride_qt": i32, "stride_s": i32}, {"TILE": 128}, {"num_warps": 8}),
        "quantize both (dy)": (fp8_quant._both_kernel, {
            "X": "*bf16", "Q": "*fp8e4nv", "S": "*fp32", "QT": "*fp8e4nv", "ST": "*fp32", "M": i32, "K": i32,
            "stride_x": i32, "stride_q": i32, "stride_s": i32, "stride_qt": i32, "stride_st": i32}, {"TILE": 128},
            {"num_warps": 8}),
        "grouped gemm (gather, scatter)": (fp8_grouped._grouped_kernel, {
            "A": "*fp8e4nv", "SA": "*fp32", "TOK": "*i32", "SLOT": "*i32", "B": "*fp8e4nv", "SB": "*fp32",
            "C": "*bf16", "OFFS": "*i32", "TILE_E": "*i32", "TILE_ROW": "*i32", "n_tiles_m": i32, "N": i32, "K": i32,
            "stride_a": i32, "stride_sa": i32, "stride_be": i32, "stride_bn": i32, "stride_sbe": i32,
            "stride_sbn": i32, "stride_c": i32},
            {"GATHER": True, "SCATTER": True, "BM": 128, "BN": 128, "BK": 128, "GROUP_M": 8, "SCALED": False},
            {"num_warps": 8, "num_stages": 4}),
        "grouped wgrad": (fp8_grouped._wgrad_kernel, {
            "AT": "*fp8e4nv", "SAT": "*fp32", "BT": "*fp8e4nv", "SBT": "*fp32", "C": "*fp32", "U_FIRST": "*i32",
            "OFFS": "*i32", "N1": i32, "N2": i32, "stride_a": i32, "stride_sa": i32,
            "stride_b": i32, "stride_sb": i32, "stride_ce": i32, "stride_c": i32},
            {"BM": 128, "BN": 128, "BK": 128, "GROUP_M": 8, "SCALED": False}, {"num_warps": 8, "num_stages": 4}),
        "plan rows_t (gather, dequant)": (fp8_grouped._plan_rows_t_kernel, {
            "X": "*fp8e4nv", "SX": "*fp32", "TOK": "*i32", "QT": "*fp8e4nv", "ST": "*fp32", "OFFS": "*i32",
            "TILE_E": "*i32", "TILE_ROW": "*i32", "C": i32, "stride_x": i32, "stride_sx": i32, "stride_qt": i32,
            "stride_st": i32}, {"GATHER": True, "DEQUANT": True, "BC": 32, "TILE": 128}, {"num_warps": 4}),
        "swiglu + quantize": (fp8_grouped._swiglu_quant_kernel, {
            "H": "*bf16", "W": "*fp32", "Q": "*fp8e4nv", "S": "*fp32", "M": i32, "I": i32, "stride_h": i32,
            "stride_q": i32, "stride_s": i32}, {"BR": 16, "TILE": 128}, {"num_warps": 4}),
    }
    rows, ok_all = [], True
    for cap in (89, 90, 120):
        for name, (fn, sig, const, opts) in kernels.items():
            t0 = time.perf_counter()
            try:
                if "SCALED" in const:  # the GEMMs take tl.dot_scaled's form on sm_12x (`fp8_gemm.block_dot`)
                    const = {**const, "SCALED": cap // 10 == 12}
                k = triton.compile(ASTSource(fn, {**sig, **{c: "constexpr" for c in const}}, const),
                                   target=GPUTarget("cuda", cap, 32), options=opts)
                ptx = k.asm["ptx"]
                mma = ("wgmma" if "wgmma" in ptx else "mma.sync mxf8f6f4 (block-scaled)" if "mxf8f6f4" in ptx
                       else "mma.sync e4m3" if "e4m3" in ptx and "mma.sync" in ptx else "-")  # fmt: skip
                rows.append([f"sm_{cap}", name, "ok", mma, f"{len(k.asm['cubin']) / 1024:.0f} KB",
                             f"{time.perf_counter() - t0:.1f} s"])
            except Exception as e:  # noqa: BLE001  (reported in the table: that is the point of the section)
                ok_all = False
                rows.append([f"sm_{cap}", name, f"FAILED: {type(e).__name__}: {str(e)[:120]}", "", "", ""])
    table(f"Triton {triton.__version__}: FP8 kernels compiled for other targets (not run)",
          ["target", "kernel", "compiled", "MMA in the PTX", "cubin", "time"], rows, out, "compile")
    return ok_all


# --------------------------------------------------------------------------------------------------------- check


def _gemm_err(gemm, a, b, out_dtype, blocks):
    """(err, err_pt): the GEMM against fp64 on the same quantized operands; err_pt the larger of PyTorch's fp32
    matmul of the dequantized operands rounded to out_dtype and the emulated promoted tensor-core sum
    (`reference.fp8.gemm_emulated`: the hardware sums each 128-block at ~14 bits, fp32 out cannot do better)."""
    qa, sa = ref.quantize_rows(a)
    qb, sb = ref.quantize_blocks(b) if blocks else ref.quantize_rows(b)
    da = ref.dequantize_rows(qa, sa)
    db = ref.dequantize_blocks(qb, sb) if blocks else ref.dequantize_rows(qb, sb)
    exact = da.double() @ db.double().t()
    err_pt = ((da @ db.t()).to(out_dtype).double() - exact).abs().max().item()
    err_hw = (ref.gemm_emulated(qa, sa, qb, sb) - exact).abs().max().item()
    got = gemm(qa, sa, qb, sb, out_dtype).double()
    return (got - exact).abs().max().item(), max(err_pt, err_hw)


def check(device, out: Path | None) -> bool:
    from anyseek.kernels import fp8 as fp8_autograd
    from anyseek.kernels.ops import fp8 as fp8_ops
    from anyseek.kernels.triton import fp8_gemm

    torch.backends.cuda.matmul.allow_tf32 = False
    g = torch.Generator(device="cpu").manual_seed(0)
    rows, ok_all = [], True
    for M, N, K in [(200, 136, 4096 + 77), (257, 300, 1024), (130, 260, 2048)]:  # small: emulated in fp64
        a = (torch.randn(M, K, generator=g) * torch.rand(M, 1, generator=g) * 10).to(device)
        b = torch.randn(N, K, generator=g).to(device)
        for out_dtype in (torch.bfloat16, torch.float32):
            for blocks in (True, False):
                err, err_pt = _gemm_err(fp8_gemm.gemm, a, b, out_dtype, blocks)
                ok = err <= 2 * err_pt + 1e-6
                ok_all &= ok
                rows.append([f"gemm {M}x{N}x{K}", f"{'128x128' if blocks else '1x128'} b, {str(out_dtype)[6:]} out",
                             f"{err:.3g}", f"{err_pt:.3g}", "pass" if ok else "FAIL"])
    x = torch.randn(2, 1000, 2048, generator=g).to(device, torch.bfloat16)
    w = (torch.randn(1408, 2048, generator=g) * 0.02).to(device)
    dy = torch.randn(2, 1000, 1408, generator=g).to(device, torch.bfloat16)
    res = []
    for fn in (fp8_ops.fp8_linear, fp8_autograd.fp8_linear_reference):
        xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()
        y = fn(xg, wg)
        y.backward(dy)
        res.append([y.float(), xg.grad.float(), wg.grad.float()])
    for name, t, r in zip(["y (bf16)", "dx (bf16)"], *(r[:2] for r in res)):
        rel = ((t - r).norm() / r.norm()).item()
        ok = rel <= 2.0 ** -8  # bf16's rounding: the two backends differ in the order of fp32 sums only
        ok_all &= ok
        rows.append(["fp8_linear 2000x2048 -> 1408", name + ": triton vs twin, rel. L2", f"{rel:.3g}", "<= 2^-8",
                     "pass" if ok else "FAIL"])
    # dW is fp32: no bf16 rounding hides how the tensor cores sum (~14 bits inside each 128-block, where the twin
    # sums exactly; 0.00528 of the twin against a 2^-8 bound on an H100, stop 45). So as the GEMM cases: against
    # fp64 on the operands the recipe quantizes (dy^T and the forward's x re-tiled, 1x128 along the tokens), within
    # 2x of the larger of the emulated promoted tensor-core sum and PyTorch's fp32 matmul
    q_x, s_x = ref.quantize_rows(x.reshape(-1, x.shape[-1]).float())
    q_dyt, s_dyt = ref.quantize_both(dy.reshape(-1, dy.shape[-1]).float())[2:]
    q_xt, s_xt = ref.requantize_t(q_x, s_x)
    da, db = ref.dequantize_rows(q_dyt, s_dyt), ref.dequantize_rows(q_xt, s_xt)
    exact = da.double() @ db.double().t()
    bound = max((da @ db.t()).double().sub(exact).abs().max().item(),
                (ref.gemm_emulated(q_dyt, s_dyt, q_xt, s_xt) - exact).abs().max().item())
    for who, dw in (("triton", res[0][2]), ("twin", res[1][2])):
        err = (dw.double() - exact).abs().max().item()
        ok = err <= 2 * bound + 1e-6
        ok_all &= ok
        rows.append(["fp8_linear 2000x2048 -> 1408", f"dW (fp32), {who} vs fp64 on the quantized operands",
                     f"{err:.3g}", f"{bound:.3g}", "pass" if ok else "FAIL"])
    table("Correctness before timing (GEMM: err vs fp64 on the same quantized operands, within 2x of the larger of "
          "PyTorch's fp32 matmul rounded to the output dtype and the emulated promoted FP8 tensor-core sum)",
          ["case", "variant", "err", "err PyTorch / bound", "result"], rows, out, "check")
    return ok_all


# ---------------------------------------------------------------------------------------------------------- gemm


def _bench(fn) -> float:
    import triton

    return triton.testing.do_bench(fn, warmup=10, rep=50, return_mode="median") * 1e-3


def _rowwise(t_MK: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One E4M3 scale per row (torch._scaled_mm's rowwise recipe): -> (q [M, K], scale [M, 1] fp32)."""
    amax = t_MK.abs().amax(dim=1, keepdim=True).float().clamp(min=1e-12)
    s = amax / 448.0
    return (t_MK.float() / s).to(torch.float8_e4m3fn), s


def gemm_tables(device, flavors, tokens_list, out: Path | None) -> None:
    from anyseek.kernels.triton import fp8_gemm, fp8_quant

    rows, qrows = [], []
    bf16 = torch.bfloat16
    for flavor in flavors:
        for T in tokens_list:
            for layer, N, K in linear_shapes(flavor):
                x = torch.randn(T, K, device=device, dtype=bf16)
                w = torch.randn(N, K, device=device) * 0.02
                dy = torch.randn(T, N, device=device, dtype=bf16)
                wb = w.to(bf16)
                q_x, s_x = fp8_quant.quantize_rows(x)
                q_w, s_w, q_wt = fp8_quant.quantize_blocks(w)
                q_dy, s_dy = fp8_quant.quantize_rows(dy)
                q_dyt, s_dyt = fp8_quant.quantize_rows_t(dy)
                q_xt, s_xt = fp8_quant.requantize_t(q_x, s_x)
                s_wt = s_w.t().contiguous()
                # rowwise peers: a's rows and b's columns each one scale (b given column-major, as cuBLAS wants)
                rx, rsx = _rowwise(x)
                rw, rsw = _rowwise(wb)
                rdy, rsdy = _rowwise(dy)
                rwt, rswt = _rowwise(wb.t().contiguous())
                rdyt, rsdyt = _rowwise(dy.t().contiguous())
                rxt, rsxt = _rowwise(x.t().contiguous())
                passes = {
                    "fprop": (T, N, K, partial(fp8_gemm.gemm, q_x, s_x, q_w, s_w, bf16),
                              partial(torch.matmul, x, wb.t()), (rx, rw.t(), rsx, rsw.t())),
                    "dgrad": (T, K, N, partial(fp8_gemm.gemm, q_dy, s_dy, q_wt, s_wt, bf16),
                              partial(torch.matmul, dy, wb), (rdy, rwt.t(), rsdy, rswt.t())),
                    "wgrad": (N, K, T, partial(fp8_gemm.gemm, q_dyt, s_dyt, q_xt, s_xt, torch.float32),
                              partial(torch.matmul, dy.t(), x), (rdyt, rxt.t(), rsdyt, rsxt.t())),
                }
                for name, (m, n, k, ours, cublas, (a, b, sa, sb)) in passes.items():
                    flop = 2 * m * n * k
                    t_ours, t_bf16 = _bench(ours), _bench(cublas)
                    peers = []
                    for fast in (False, True):
                        try:
                            t = _bench(partial(torch._scaled_mm, a, b, scale_a=sa, scale_b=sb, out_dtype=bf16,
                                               use_fast_accum=fast))
                            peers.append(f"{flop / t / 1e12:.0f}")
                        except (RuntimeError, TypeError) as e:
                            peers.append(f"n/a ({str(e)[:40]})")
                    rows.append([flavor, T, layer, name, f"{m}x{n}x{k}", f"{flop / t_ours / 1e12:.0f}",
                                 f"{flop / t_bf16 / 1e12:.0f}", *peers, f"{t_bf16 / t_ours:.2f}x"])
                    print(" | ".join(str(c) for c in rows[-1]), flush=True)
                quants = {"x rows": (partial(fp8_quant.quantize_rows, x), x.numel() * 3),
                          "W blocks + W^T (fp32 in)": (partial(fp8_quant.quantize_blocks, w), w.numel() * 6),
                          "dy rows + dy^T rows (one read)": (partial(fp8_quant.quantize_both, dy), dy.numel() * 4),
                          "x^T re-tiled from FP8 x": (partial(fp8_quant.requantize_t, q_x, s_x), x.numel() * 2)}
                for qname, (fn, nbytes) in quants.items():
                    t = _bench(fn)
                    qrows.append([flavor, T, layer, qname, f"{t * 1e6:.1f}", f"{nbytes / t / 1e9:.0f}"])
                del x, w, dy, wb, q_x, q_w, q_wt, q_dy, q_dyt, q_xt, rx, rw, rdy, rwt, rdyt, rxt
                torch.cuda.empty_cache()
    table("Dense FP8 GEMMs, TFLOP/s (operands already quantized; bf16 out, Wgrad fp32 out)",
          ["flavor", "tokens", "layer", "pass", "M x N x K", "ours (Triton, 1x128/128x128, promoted)",
           "cuBLAS bf16", "_scaled_mm rowwise", "_scaled_mm rowwise fast-accum", "ours / bf16"], rows, out, "gemm")
    table("Quantization kernels (E4M3, fp32 scales): time and GB/s of bytes read + written",
          ["flavor", "tokens", "layer", "quantize", "us", "GB/s"], qrows, out, "quant")


def grouped_table(device, flavors, tokens_list, out: Path | None) -> None:
    from anyseek.kernels.triton import fp8_grouped, moe, moe_plan
    from anyseek.kernels.triton.moe_gemm import EPI_PLAIN
    from anyseek.model.config import ModelConfig

    rows = []
    bf16 = torch.bfloat16
    for flavor in flavors:
        c = ModelConfig.from_name(flavor)
        E, I, K, D = c.n_routed_experts, c.moe_intermediate_size, c.num_experts_per_tok, c.hidden_size
        for T in tokens_list:
            ids = torch.rand(T, E, device=device).argsort(dim=1)[:, :K].contiguous()  # K distinct experts, uniform
            cfg = moe._config(device, "gemm")
            bm = cfg["BLOCK_M"]
            plan = moe_plan.build_plan(ids, E, bm)
            M = T * K
            x = torch.randn(T, D, device=device, dtype=bf16)
            act = torch.randn(M, I, device=device, dtype=bf16)
            gu = torch.randn(E, 2 * I, D, device=device) * 0.02
            dn = torch.randn(E, D, I, device=device) * 0.02
            q_x, s_x = ref.quantize_rows(x)
            q_act, s_act = ref.quantize_rows(act)
            q_gu, s_gu = ref.quantize_expert_blocks(gu)
            q_dn, s_dn = ref.quantize_expert_blocks(dn)
            gu_b, dn_b = gu.to(bf16), dn.to(bf16)
            x_perm = x[plan[1].long()]
            offs = plan[2][1:].contiguous()
            cases = {
                "gate|up (gather)": (2 * I, D,
                                     partial(fp8_grouped.grouped_gemm, q_x, s_x, q_gu, s_gu, plan, bm, bf16, True),
                                     partial(moe._gemm, x, gu_b, moe._nk(gu_b), torch.empty(M, 2 * I, device=device,
                                             dtype=bf16), plan, 2 * I, D, cfg, gather=True, epi=EPI_PLAIN),
                                     partial(torch._grouped_mm, x_perm, gu_b.transpose(1, 2), offs=offs)),
                "down (scatter)": (D, I,
                                   partial(fp8_grouped.grouped_gemm, q_act, s_act, q_dn, s_dn, plan, bm, bf16, False,
                                           True),
                                   partial(moe._gemm, act, dn_b, moe._nk(dn_b), torch.empty(M, D, device=device,
                                           dtype=bf16), plan, D, I, cfg, scatter=True, epi=EPI_PLAIN),
                                   partial(torch._grouped_mm, act, dn_b.transpose(1, 2), offs=offs)),
            }  # fmt: skip
            for name, (N, Kr, ours, bf16_triton, grouped_mm) in cases.items():
                flop = 2 * M * N * Kr
                res = []
                for fn in (ours, bf16_triton, grouped_mm):
                    try:
                        res.append(f"{flop / _bench(fn) / 1e12:.0f}")
                    except (RuntimeError, TypeError, ValueError) as e:
                        res.append(f"n/a ({str(e)[:40]})")
                rows.append([flavor, T, f"{E} experts, top-{K}", name, f"{M}x{N}x{Kr}", *res])
                print(" | ".join(str(v) for v in rows[-1]), flush=True)
            del x, act, gu, dn, q_x, q_act, q_gu, q_dn, gu_b, dn_b, x_perm
            torch.cuda.empty_cache()
    table("Grouped FP8 GEMM of the routed experts, forward, TFLOP/s (operands already quantized; bf16 out)",
          ["flavor", "tokens", "experts", "GEMM", "M x N x K", "ours (Triton FP8, promoted)",
           "anyseek Triton bf16", "torch._grouped_mm bf16"], rows, out, "grouped")
    experts_table(device, flavors, tokens_list, out)


def _experts_step(fn, x, ids, w, gate_up, down, dy) -> None:
    fn(x, ids, w, gate_up, down).backward(dy)


def _experts_cases(device, flavors, tokens_list):
    """For each flavor and token count, the routed experts' forward + backward on the same inputs (balanced random
    routing): -> (flavor, T, config, FP8 step, bf16 Triton step); FP8 takes fp32 weights (quantized each call),
    bf16 their bf16 copies. The generator lets go of a case's tensors when asked for the next (the caller drops its
    steps first)."""
    from anyseek.kernels.ops import fp8 as fp8_ops
    from anyseek.kernels.ops import moe as moe_ops
    from anyseek.model.config import ModelConfig

    for flavor in flavors:
        c = ModelConfig.from_name(flavor)
        E, I, K, D = c.n_routed_experts, c.moe_intermediate_size, c.num_experts_per_tok, c.hidden_size
        for T in tokens_list:
            ids = torch.rand(T, E, device=device).argsort(dim=1)[:, :K].contiguous()
            w = torch.rand(T, K, device=device)
            x = torch.randn(T, D, device=device, dtype=torch.bfloat16, requires_grad=True)
            gu = (torch.randn(E, 2 * I, D, device=device) * 0.02).requires_grad_()
            dn = (torch.randn(E, D, I, device=device) * 0.02).requires_grad_()
            gub, dnb = gu.detach().bfloat16().requires_grad_(), dn.detach().bfloat16().requires_grad_()
            dy = torch.randn(T, D, device=device, dtype=torch.bfloat16)
            yield (flavor, T, c, partial(_experts_step, fp8_ops.fp8_routed_experts, x, ids, w, gu, dn, dy),
                   partial(_experts_step, moe_ops.routed_experts, x, ids, w, gub, dnb, dy))  # fmt: skip
            del x, gu, dn, gub, dnb, dy
            torch.cuda.empty_cache()


def experts_table(device, flavors, tokens_list, out: Path | None) -> None:
    """The routed experts' whole forward + backward (quantization, plan, GEMMs, SwiGLU, combine): FP8 against the
    bf16 Triton experts (`kernels/ops/moe.py`), same inputs."""
    rows = []
    for flavor, T, c, fp8_step, bf16_step in _experts_cases(device, flavors, tokens_list):
        E, I, K, D = c.n_routed_experts, c.moe_intermediate_size, c.num_experts_per_tok, c.hidden_size
        flop = 18 * T * K * D * I  # forward 6 M D I, backward twice that
        t8, t16 = _bench(fp8_step), _bench(bf16_step)
        rows.append([flavor, T, f"{E} experts, top-{K}", f"{t8 * 1e3:.2f}", f"{flop / t8 / 1e12:.0f}",
                     f"{t16 * 1e3:.2f}", f"{flop / t16 / 1e12:.0f}", f"{t16 / t8:.2f}x"])
        print(" | ".join(str(v) for v in rows[-1]), flush=True)
        del fp8_step, bf16_step  # (the case's tensors freed before the next is made)
    table("Routed experts, forward + backward (FP8: weights quantized from fp32 each call; bf16: bf16 weights)",
          ["flavor", "tokens", "experts", "FP8 ms", "FP8 TFLOP/s", "bf16 Triton ms", "bf16 TFLOP/s", "FP8 speed-up"],
          rows, out, "experts")


def kernel_table(prof, steps: int, top: int = 14) -> list[list]:
    """torch.profiler's kernels, summed by name: [name, calls a step, ms a step, share] for the `top` longest, then
    the rest in one row, then the total."""
    by: dict[str, list] = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA and e.device_time > 0:
            row = by.setdefault(e.name, [0, 0.0])
            row[0] += 1
            row[1] += e.device_time
    total = sum(v[1] for v in by.values()) or 1.0
    ranked = sorted(by.items(), key=lambda kv: -kv[1][1])
    rows = [[name[:70], f"{n / steps:.0f}", f"{us / steps / 1e3:.3f}", f"{100 * us / total:.1f}%"]
            for name, (n, us) in ranked[:top]]  # fmt: skip
    rest = ranked[top:]
    if rest:
        rows.append([f"({len(rest)} other kernels)", f"{sum(v[0] for _, v in rest) / steps:.0f}",
                     f"{sum(v[1] for _, v in rest) / steps / 1e3:.3f}",
                     f"{100 * sum(v[1] for _, v in rest) / total:.1f}%"])  # fmt: skip
    rows.append(["total", f"{sum(v[0] for v in by.values()) / steps:.0f}", f"{total / steps / 1e3:.3f}", "100%"])
    return rows


def _profile(fn, steps: int = 3):
    from torch.profiler import ProfilerActivity, profile

    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            fn()
        torch.cuda.synchronize()
    return kernel_table(prof, steps)


def experts_profile(device, flavors, tokens_list, out: Path | None) -> None:
    """The routed experts' forward + backward under torch.profiler, FP8 and bf16: the kernel tables."""
    for flavor, T, _, fp8_step, bf16_step in _experts_cases(device, flavors, tokens_list):
        for name, fn in (("fp8", fp8_step), ("bf16", bf16_step)):
            table(f"Routed experts fwd + bwd, {flavor}, {T} tokens, {name}: kernels a step",
                  ["kernel", "calls", "ms", "share"], _profile(fn), out, f"profile-experts-{flavor}-{T}-{name}")
        del fn, fp8_step, bf16_step  # (the case's tensors freed before the next is made)


def tune_table(device, out: Path | None) -> None:
    from anyseek.kernels.triton import fp8_gemm

    # (BM, BN, warps, stages, variant): strided = scales [M, KB] read row by row; side = scales [KB, M] side by side
    configs = [(128, 128, 8, 4, "strided"), (128, 128, 8, 4, "side"), (128, 128, 8, 3, "side"),
               (128, 128, 8, 5, "strided"), (128, 256, 8, 3, "side"), (256, 128, 8, 3, "strided"),
               (64, 128, 4, 4, "side")]
    shapes = [("small dense gate|up fprop", 32768, 8192, 1024, torch.bfloat16, True),
              ("16B dense down fprop", 32768, 2048, 11264, torch.bfloat16, True),
              ("16B dense gate|up wgrad", 22528, 2048, 32768, torch.float32, False)]
    rows = []
    for name, M, N, K, out_dtype, blocks in shapes:
        a = torch.randn(M, K, device=device).to(torch.float8_e4m3fn)
        b = torch.randn(N, K, device=device).to(torch.float8_e4m3fn)
        sa = torch.rand(M, _n_blocks(K), device=device) + 0.5
        sb = torch.rand(_n_blocks(N) if blocks else N, _n_blocks(K), device=device) + 0.5
        for bm, bn, warps, stages, variant in configs:
            cfg = {"BM": bm, "BN": bn, "GROUP_M": 8, "num_warps": warps, "num_stages": stages,
                   "SCALES_T": variant == "side"}
            tile = f"{bm}x{bn} {variant}"
            try:
                t = _bench(partial(fp8_gemm.gemm, a, sa, b, sb, out_dtype, config=cfg))
                rows.append([name, f"{M}x{N}x{K}", tile, warps, stages, f"{2 * M * N * K / t / 1e12:.0f}"])
            except Exception as e:  # noqa: BLE001  (a setting that cannot run is a row of the table)
                rows.append([name, f"{M}x{N}x{K}", tile, warps, stages, f"failed: {str(e)[:60]}"])
            print(" | ".join(str(c) for c in rows[-1]), flush=True)
        del a, b
        torch.cuda.empty_cache()
    table("FP8 GEMM launch settings (TFLOP/s; stages lowered automatically where shared memory is short)",
          ["shape", "M x N x K", "tile", "warps", "stages", "TFLOP/s"], rows, out, "tune")


def _n_blocks(n: int) -> int:
    """128-blocks covering n."""
    return -(-n // 128)


# --------------------------------------------------------------------------------------------------------- train


def train_case(args) -> None:
    """One training case in this process: prints RESULT {...}."""
    from anyseek.data.prepare import ensure_prepared
    from anyseek.train.config import load_run_config
    from anyseek.train.trainer import Trainer

    precision, tokens, flavor = args.train_case.split(":")
    data_dir = args.data or ensure_prepared("wiki-sample", vocab_size=32000)
    overrides = [f"--data.path={json.dumps(str(data_dir))}", f"--data.tokens_per_batch={tokens}",
                 "--data.max_seqlen=2048", "--train.tensorboard=false", f"--train.precision={precision}",
                 "--train.eval_every=100000", "--train.save_every=100000", "--train.warmup_steps=5",
                 *(["--train.cuda_graphs=false"] if args.eager else [])]
    name, _, layers = flavor.partition("/")
    if layers:  # a one-GPU proxy of a larger flavor: its shapes, fewer decoder layers
        overrides.append(f"--model.num_hidden_layers={layers}")
    cfg = load_run_config(name, overrides)
    with tempfile.TemporaryDirectory() as tmp:
        tr = Trainer(cfg, Path(tmp) / "run", log=lambda *a: None)
        batches = iter(tr.train_loader)
        losses = []

        def step():
            for o in tr.engine.advance(batches):
                losses.append(o.values["loss"])
                if not o.ok:
                    raise RuntimeError("non-finite step")

        for _ in range(args.warmup):
            step()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(args.steps):
            step()
        tr.engine.flush()
        torch.cuda.synchronize()
        dt = (time.perf_counter() - t0) / args.steps
        print("RESULT " + json.dumps({"ms": dt * 1e3, "tok_s": int(tokens) / dt,
                                      # the whole run's peaks (graph capture and pools included): what the
                                      # GPU must hold, allocated and as the caching allocator reserves it
                                      "mem": torch.cuda.max_memory_allocated() / 2**30,
                                      "reserved": torch.cuda.max_memory_reserved() / 2**30,
                                      "loss_first": losses[0], "loss_last": losses[-1]}), flush=True)
        if args.profile_steps:
            print("PROFILE " + json.dumps(_profile(step, args.profile_steps)), flush=True)


def train_profile(tokens_list, args, out: Path | None) -> None:
    """The training step's kernels, bf16 and FP8, eager (`--train.cuda_graphs=false`: every kernel attributed)."""
    for flavor, tokens in [(f, t) for f in args.train_flavors.split(",") for t in tokens_list]:
        for precision in ("bf16", "fp8"):
            cmd = [sys.executable, __file__, "--train-case", f"{precision}:{tokens}:{flavor}", "--steps", "3",
                   "--warmup", "3", "--profile-steps", "3", "--eager", *(["--data", args.data] if args.data else [])]
            p = subprocess.run(cmd, capture_output=True, text=True, check=False)
            res = [ln for ln in p.stdout.splitlines() if ln.startswith("PROFILE ")]
            if p.returncode or not res:
                print(f"profile {precision} {tokens}: FAILED\n{p.stdout[-2000:]}\n{p.stderr[-3000:]}", flush=True)
                continue
            table(f"Training step, {flavor}, {tokens} tokens, {precision} (eager): kernels a step",
                  ["kernel", "calls", "ms", "share"], json.loads(res[-1][len("PROFILE "):]), out,
                  f"profile-train-{flavor.replace('/', '-')}-{tokens}-{precision}")


def train_table(tokens_list, args, out: Path | None) -> None:
    rows = []
    for flavor, tokens in [(f, t) for f in args.train_flavors.split(",") for t in tokens_list]:
        got = {}
        for precision in ("bf16", "fp8"):
            cmd = [sys.executable, __file__, "--train-case", f"{precision}:{tokens}:{flavor}", "--steps",
                   str(args.steps), "--warmup", str(args.warmup), *(["--data", args.data] if args.data else [])]
            p = subprocess.run(cmd, capture_output=True, text=True, check=False)
            res = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
            if p.returncode or not res:
                print(f"train {precision} {tokens}: FAILED\n{p.stdout[-2000:]}\n{p.stderr[-3000:]}", flush=True)
                rows.append([flavor, tokens, precision, "FAILED", "", "", "", ""])
                continue
            r = got[precision] = json.loads(res[-1][len("RESULT "):])
            speed = f"{got['bf16']['ms'] / r['ms']:.2f}x" if "bf16" in got else ""
            rows.append([flavor, tokens, precision, f"{r['ms']:.1f}", f"{r['tok_s']:,.0f}",
                         f"{r['mem']:.2f} / {r.get('reserved', float('nan')):.2f}",
                         f"{r['loss_first']:.4f} -> {r['loss_last']:.4f}", speed])
            print(" | ".join(str(c) for c in rows[-1]), flush=True)
    table(f"Training step (`anyseek train`'s step: CUDA graphs, bf16 working copy; {args.warmup} warm-up "
          f"+ {args.steps} timed steps)", ["flavor", "tokens", "precision", "ms/step", "tokens/s", "peak GiB (allocated / reserved, whole run)",
                                           "loss (first -> last step)", "vs bf16"], rows, out, "train")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", default=",".join(DEFAULT), help=f"comma-separated sections of {', '.join(SECTIONS)} "
                   f"(default: all but tune)")
    p.add_argument("--flavors", default="small,16B")
    p.add_argument("--tokens", default="8192,32768")
    p.add_argument("--steps", type=int, default=20, help="timed training steps per case")
    p.add_argument("--warmup", type=int, default=8, help="training steps before timing (graph capture included)")
    p.add_argument("--out", default=None)
    p.add_argument("--data", default=None, help="train: a prepared corpus (default: the Wikipedia sample at vocab "
                   "32000, prepared on first use)")
    p.add_argument("--train-flavors", default="small", help="train: flavors, FLAVOR/N for its shapes cut to N "
                   "decoder layers (e.g. small,16B/4)")
    p.add_argument("--train-case", default=None, help=argparse.SUPPRESS)
    p.add_argument("--profile-steps", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--eager", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.train_case:
        return train_case(args)
    out = Path(args.out) if args.out else None
    sections = [s for s in args.only.split(",") if s]
    unknown = set(sections) - set(SECTIONS)
    if unknown:
        raise SystemExit(f"--only: unknown {sorted(unknown)}; known: {', '.join(SECTIONS)}")
    tokens = [int(t) for t in args.tokens.split(",")]
    import triton

    print(f"anyseek benchmarks/fp8.py, {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC, torch {torch.__version__}, "
          f"triton {triton.__version__}, python {platform.python_version()}", flush=True)
    ok = True
    if "compile" in sections:
        ok &= compile_targets(out)
    if any(s in sections for s in ("check", "gemm", "quant", "grouped", "train", "tune", "profile")):
        if not torch.cuda.is_available():
            raise SystemExit("check/gemm/quant/train need a CUDA GPU (--only compile runs without one)")
        device = torch.device("cuda")
        major, minor = torch.cuda.get_device_capability(device)
        print(f"device: {torch.cuda.get_device_name(device)} (sm_{major}{minor})", flush=True)
        if (major, minor) < (8, 9):
            raise SystemExit("FP8 needs compute capability 8.9+")
        if not check(device, out):
            print("correctness check FAILED: no timing", flush=True)
            sys.exit(1)
        if "gemm" in sections or "quant" in sections:
            gemm_tables(device, args.flavors.split(","), tokens, out)
        if "grouped" in sections:
            grouped_table(device, args.flavors.split(","), tokens, out)
        if "tune" in sections:
            tune_table(device, out)
        if "train" in sections:
            train_table(tokens, args, out)
        if "profile" in sections:
            experts_profile(device, args.flavors.split(","), tokens, out)
            train_profile(tokens, args, out)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
