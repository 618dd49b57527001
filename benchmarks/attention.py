"""MLA attention on one GPU: correctness sweep, launch-setting sweep, and the table against the peers.

    python benchmarks/attention.py --check            # worst error ratios vs the fp32 reference (2x rule)
    python benchmarks/attention.py --tune             # our kernels under several launch settings
    python benchmarks/attention.py --bench            # forward and forward+backward vs SDPA and FlexAttention
    --out DIR writes check.md / tune.md / bench.md there as well as printing them.

Cases: dense causal (one sequence, S=4096, H=16 and 128) and one row of 16,384 tokens packed with whole
documents whose lengths follow the real Wikipedia lead sample (benchmarks/wiki_lead_lengths.json: byte-level
BPE, vocab 8192; mean 117 tokens), plus a row of two long documents. MLA dims: q/k 128 nope + 64 rope, v 128.
TFLOP/s count only unmasked work: forward 2*H*sum(L^2)/2*(d_qk+d_v), forward+backward 3.5x that (the
convention of shared/BASELINES.md). Times are medians of triton.testing.do_bench (CUDA events).
Peers get their inputs already laid out as they need them ([1, H, S, D], k_pe expanded per head, V padded
for SDPA flash): that preparation is not timed, which favours them.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import sys
import time
from datetime import datetime, timezone

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
N, R, V = 128, 64, 128


def wiki_row(tokens: int, seed: int) -> list[int]:
    """Whole lead sections drawn at random until the row is full; the last one is cut to fit."""
    with open(os.path.join(HERE, "wiki_lead_lengths.json")) as f:
        pool = json.load(f)["lengths"]
    rng = random.Random(seed)
    lengths: list[int] = []
    while sum(lengths) < tokens:
        lengths.append(rng.choice(pool))
    lengths[-1] -= sum(lengths) - tokens
    return lengths


def env_line() -> str:
    import triton

    p = torch.cuda.get_device_properties(0)
    return (
        f"{p.name} ({p.multi_processor_count} SMs), PyTorch {torch.__version__}, Triton {triton.__version__}, "
        f"cuDNN {torch.backends.cudnn.version()}, {platform.system()}, "
        f"{datetime.now(timezone.utc).strftime('%Y-%m-%d %H:%M UTC')}"
    )


def emit(lines: list[str], out_dir: str | None, name: str) -> None:
    text = "\n".join(lines)
    print(text, flush=True)
    if out_dir:
        with open(os.path.join(out_dir, name), "w") as f:
            f.write(text + "\n")


# ---------------------------------------------------------------------------------------------------- check


def check(out_dir: str | None) -> bool:
    from anyseek.kernels import accuracy, ops

    g = torch.Generator().manual_seed(0)
    rand = [1] + torch.randint(1, 700, (12,), generator=g).tolist() + [1, 129]
    short = torch.randint(1, 9, (1000,), generator=g).tolist()
    cases = []
    for H in (1, 16, 128):
        for dt in (torch.bfloat16, torch.float16):
            cases.append(("mla", f"random lengths incl. 1 (T={sum(rand)})", rand, H, (N, R, V), dt, True))
    cases.append(("mla", "1000 docs of 1-8 tokens", short, 16, (N, R, V), torch.bfloat16, True))
    cases.append(("mla", "1000 docs of 1-8 tokens", short, 128, (N, R, V), torch.bfloat16, True))
    cases.append(("mla", "one doc of 4001", [4001], 16, (N, R, V), torch.bfloat16, True))
    cases.append(("mla", "one doc of 1537", [1537], 128, (N, R, V), torch.bfloat16, True))
    cases.append(("mla", "random, non-causal", rand, 16, (N, R, V), torch.bfloat16, False))
    for dims in ((64, 64), (128, 128), (192, 128), (256, 256), (96, 80), (40, 24)):
        for causal in (True, False):
            cases.append(("varlen", f"random lengths, d_qk/d_v {dims}", rand, 8, dims, torch.bfloat16, causal))
    lines = [f"# correctness: {env_line()}", "", "| op | case | H | dtype | causal | worst ratio | worst grad | pass |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]  # fmt: skip
    ok_all, worst = True, 0.0
    for kind, what, lengths, H, dims, dt, causal in cases:
        op = "mla_attention" if kind == "mla" else "varlen_attention"
        table = accuracy.error_table(getattr(ops, op), op, lengths, H, dims, dt, "cuda", causal)
        ratios = {n: e / max(p, 1e-12) for n, e, p in table}
        name = max(ratios, key=ratios.get)
        ok = accuracy.passes(table, dt)
        ok_all &= ok
        worst = max(worst, ratios[name])
        lines.append(
            f"| {op} | {what} | {H} | {str(dt)[6:]} | {causal} | {ratios[name]:.2f} | {name} | {'yes' if ok else 'NO'} |"
        )
        torch.cuda.empty_cache()
    # 64-bit offsets: the last document starts past 2**31 elements of q (T * H * 192 > 2**31)
    table = accuracy.tail_document_table(ops.mla_attention, 90_000, 128, 1000, torch.bfloat16, "cuda")
    ratios = {n: e / max(p, 1e-12) for n, e, p in table}
    name = max(ratios, key=ratios.get)
    ok = accuracy.passes(table, torch.bfloat16)
    ok_all &= ok
    worst = max(worst, ratios[name])
    lines.append(f"| mla_attention | T=90000, last doc of 1000 past 2^31 elements | 128 | bfloat16 | True | "
                 f"{ratios[name]:.2f} | {name} | {'yes' if ok else 'NO'} |")  # fmt: skip
    lines.append(f"\nworst ratio over the sweep: {worst:.2f} (rule: <= 2); all pass: {ok_all}")
    emit(lines, out_dir, "check.md")
    return ok_all


# ---------------------------------------------------------------------------------------------------- timing


def mla_inputs(lengths: list[int], H: int):
    T = sum(lengths)
    dev = "cuda"
    mk = lambda *s: (torch.randn(*s, device=dev) * 0.5).to(torch.bfloat16).requires_grad_()
    q, kn, kp, v = mk(T, H, N + R), mk(T, H, N), mk(T, R), mk(T, H, V)
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32, device=dev)
    return q, kn, kp, v, cu


def bench_fn(fn, grads, do_bwd: bool, dout=None) -> float:
    from triton.testing import do_bench

    if not do_bwd:
        with torch.no_grad():
            return do_bench(fn, warmup=25, rep=100, return_mode="median")

    def step():
        fn().backward(dout)

    return do_bench(step, warmup=25, rep=100, grad_to_none=grads, return_mode="median")


def flops(lengths: list[int], H: int) -> float:
    return 2 * H * sum(n * n for n in lengths) / 2 * (N + R + V)


def ours(lengths, H):
    from anyseek.kernels.ops import attention as ops

    q, kn, kp, v, cu = mla_inputs(lengths, H)
    mx = max(lengths)
    dout = torch.randn(sum(lengths), H, V, device="cuda", dtype=torch.bfloat16)
    return (lambda: ops.mla_attention(q, kn, kp, v, cu, mx)), [q, kn, kp, v], dout


# launch settings tried per kernel, for long documents (dense rows) and for short ones (Wikipedia leads)
VARIANTS = {
    "long": {
        "fwd": [(128, 64, 8, 3), (128, 64, 8, 4), (128, 128, 8, 3), (128, 64, 8, 5), (128, 32, 8, 4), (64, 128, 4, 3)],
        "dkdv": [(32, 128, 8, 2), (32, 128, 8, 3), (64, 128, 8, 3), (32, 128, 8, 4), (64, 64, 8, 3), (16, 128, 8, 3)],
        "dq": [(128, 64, 8, 3), (128, 64, 8, 4), (128, 128, 8, 2), (128, 32, 8, 3), (64, 64, 4, 3)],
    },
    "short": {
        "fwd": [(64, 32, 4, 2), (32, 32, 4, 3), (64, 32, 4, 3), (64, 16, 4, 2), (32, 16, 4, 2)],
        "dkdv": [(32, 128, 8, 2), (32, 64, 8, 2), (16, 64, 4, 2), (32, 32, 4, 2), (64, 64, 8, 2)],
        "dq": [(64, 32, 4, 2), (32, 32, 4, 2), (64, 16, 4, 2), (32, 64, 4, 2), (128, 32, 8, 2)],
    },
}


def tune(out_dir: str | None) -> None:
    """One kernel's launch settings varied at a time, the others at their defaults."""
    from anyseek.kernels.triton import attention as ta

    base = ta._config
    cases = [("dense S=4096 H=128", [4096], 128, "long"), ("wiki leads 16k H=128", wiki_row(16384, 1), 128, "short"),
             ("wiki leads 16k H=16", wiki_row(16384, 0), 16, "short"), ("dense S=4096 H=16", [4096], 16, "long")]  # fmt: skip
    lines = [f"# launch settings: {env_line()}", "", "fwd rows time the forward; dkdv/dq rows time forward+backward.",
             "", "| case | kernel | BM, BN, warps, stages | ms | TFLOP/s |", "| --- | --- | --- | --- | --- |"]  # fmt: skip
    for what, lengths, H, length_class in cases:
        fn, grads, dout = ours(lengths, H)
        for kind, variants in VARIANTS[length_class].items():
            for bm, bn, w, st in variants:
                cfg = {"BLOCK_M": bm, "BLOCK_N": bn, "num_warps": w, "num_stages": st}
                ta._config = lambda k, *a, _k=kind, _c=cfg: _c if k == _k else base(k, *a)
                try:
                    ms = bench_fn(fn, grads, kind != "fwd", dout)
                    tf = (1 if kind == "fwd" else 3.5) * flops(lengths, H) / ms / 1e9
                    lines.append(f"| {what} | {kind} | {bm}, {bn}, {w}, {st} | {ms:.3f} | {tf:.0f} |")
                except Exception as e:  # noqa: BLE001 - a setting that does not fit (shared memory) is a result too
                    lines.append(
                        f"| {what} | {kind} | {bm}, {bn}, {w}, {st} | failed: {type(e).__name__} {str(e)[:80]} | |"
                    )
                print(lines[-1], flush=True)
                ta._config = base
        del fn, grads, dout
        torch.cuda.empty_cache()
    emit(lines, out_dir, "tune.md")


def peers(lengths: list[int], H: int, skip_flex: bool):
    """name -> (fn, grads, dout, right_masking) for the peers, inputs prepared outside the timing."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from anyseek.kernels import torch_backends

    T = sum(lengths)
    q, kn, kp, v, cu = mla_inputs(lengths, H)
    dout_thv = torch.randn(T, H, V, device="cuda", dtype=torch.bfloat16)
    q4 = q.detach().transpose(0, 1)[None].contiguous().requires_grad_()
    k4 = torch.cat([kn.detach(), kp.detach()[:, None].expand(T, H, R)], -1).transpose(0, 1)[None].contiguous()
    k4.requires_grad_()
    v4 = v.detach().transpose(0, 1)[None].contiguous().requires_grad_()
    v4p = F.pad(v4.detach(), (0, N + R - V)).requires_grad_()
    d4 = dout_thv.transpose(0, 1)[None].contiguous()
    d4p = F.pad(d4, (0, N + R - V))
    packed = len(lengths) > 1
    out = {}

    def sdpa(backend, vv):
        def fn():
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(q4, k4, vv, is_causal=True)

        return fn

    out["SDPA cuDNN" + (" (one causal sequence: wrong)" if packed else "")] = (
        sdpa(SDPBackend.CUDNN_ATTENTION, v4),
        [q4, k4, v4],
        d4,
        not packed,
    )
    out["SDPA memory-efficient" + (" (wrong)" if packed else "")] = (
        sdpa(SDPBackend.EFFICIENT_ATTENTION, v4),
        [q4, k4, v4],
        d4,
        not packed,
    )
    out["SDPA flash, V padded to 192" + (" (wrong)" if packed else "")] = (
        sdpa(SDPBackend.FLASH_ATTENTION, v4p),
        [q4, k4, v4p],
        d4p,
        not packed,
    )
    if not skip_flex:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        doc = torch.repeat_interleave(torch.arange(len(lengths), device="cuda"), torch.tensor(lengths, device="cuda"))

        def mask_mod(b, h, qi, ki):
            return (doc[qi] == doc[ki]) & (qi >= ki)

        bm = create_block_mask(mask_mod, None, None, T, T, device="cuda")
        flex = torch.compile(flex_attention, dynamic=False)
        out["FlexAttention" + (", document mask" if packed else ", causal")] = (
            lambda: flex(q4, k4, v4, block_mask=bm),
            [q4, k4, v4],
            d4,
            True,
        )
    if packed:
        mx = max(lengths)
        out["anyseek sdpa backend (length buckets)"] = (
            lambda: torch_backends.sdpa_mla_attention(q, kn, kp, v, cu, mx),
            [q, kn, kp, v],
            dout_thv,
            True,
        )
    return out


def bench(out_dir: str | None, skip_flex: bool) -> None:
    cases = [
        ("dense causal H=16 S=4096", [4096], 16),
        ("dense causal H=128 S=4096", [4096], 128),
        ("wiki leads H=16 (16k row)", wiki_row(16384, 0), 16),
        ("wiki leads H=128 (16k row)", wiki_row(16384, 1), 128),
        ("two long docs H=128 (9000 + 7384)", [9000, 7384], 128),
    ]
    lines = [f"# MLA attention (d_qk 192 = 128 + 64 shared rope, d_v 128, bf16): {env_line()}", "",
             "| case | path | fwd ms | fwd TFLOP/s | fwd+bwd ms | fwd+bwd TFLOP/s |",
             "| --- | --- | --- | --- | --- | --- |"]  # fmt: skip
    for what, lengths, H in cases:
        what = f"{what}, {len(lengths)} docs" if len(lengths) > 2 else what
        fl = flops(lengths, H)
        fn, grads, dout = ours(lengths, H)
        paths = {"anyseek triton": (fn, grads, dout, True)}
        paths.update(peers(lengths, H, skip_flex))
        for name, (f, g, d, _) in paths.items():
            try:
                t0 = time.time()
                fw = bench_fn(f, g, False)
                fb = bench_fn(f, g, True, d)
                lines.append(
                    f"| {what} | {name} | {fw:.3f} | {fl / fw / 1e9:.0f} | {fb:.3f} | {3.5 * fl / fb / 1e9:.0f} |"
                )
                print(lines[-1], f"({time.time() - t0:.0f} s)", flush=True)
            except Exception as e:  # noqa: BLE001 - a peer that cannot run this shape is a result
                lines.append(f"| {what} | {name} | failed: {type(e).__name__}: {str(e)[:100]} | | | |")
                print(lines[-1], flush=True)
        del paths, fn, grads, dout
        torch.cuda.empty_cache()
    emit(lines, out_dir, "bench.md")


def profile(out_dir: str | None) -> None:
    """Where the time goes for the H=16 rows: kernel times vs wall time (launch overhead)."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as tprof

    lines = []
    for what, lengths, H in (("dense S=4096 H=16", [4096], 16), ("wiki leads 16k H=16", wiki_row(16384, 0), 16)):
        fn, _grads, dout = ours(lengths, H)
        for _ in range(3):
            fn().backward(dout)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(10):
            fn().backward(dout)
        t_launch = (time.perf_counter() - t0) / 10
        torch.cuda.synchronize()
        t_all = (time.perf_counter() - t0) / 10
        with tprof(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                fn().backward(dout)
            torch.cuda.synchronize()
        lines.append(f"## {what}: host issue {t_launch * 1e3:.3f} ms/step, wall {t_all * 1e3:.3f} ms/step")
        lines.append(prof.key_averages().table(sort_by="cuda_time_total", row_limit=18, max_name_column_width=40))
    emit(lines, out_dir, "profile.md")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--check", action="store_true")
    p.add_argument("--tune", action="store_true")
    p.add_argument("--bench", action="store_true")
    p.add_argument("--profile", action="store_true")
    p.add_argument("--no-flex", action="store_true", help="skip FlexAttention (its compile takes minutes)")
    p.add_argument("--out", default=os.environ.get("OUT"))
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA GPU")
        return 2
    if a.out:
        os.makedirs(a.out, exist_ok=True)
    ok = True
    if a.check:
        ok = check(a.out)
    if a.profile:
        profile(a.out)
    if a.bench:
        bench(a.out, a.no_flex)
    if a.tune:
        tune(a.out)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
