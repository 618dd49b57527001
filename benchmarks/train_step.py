"""Training throughput: anyseek vs Hugging Face transformers' DeepseekV3ForCausalLM, on CPU or one GPU.

Same model config (`--flavor`, default tiny), same weights (copied through a saved checkpoint), same batches (the built-in
Wikipedia sample), same optimizer (AdamW, foreach), same thread count, same run. One step = forward + backward +
clip + AdamW step. transformers has no multi-token prediction and no packed-document masking, so the like-for-like rows
run anyseek with MTP off on the same [B, S] rows; the rows after show anyseek as it really trains (packed documents,
MTP on).

CPU (the default): every case runs in a fresh process of its own, once per round, the cases taking turns round after
round (`--rounds`), so that no case inherits another's heap and a slow minute on a shared machine hits every case
alike. anyseek's cases run as `anyseek train` runs them, with glibc malloc tuned (`anyseek.runtime`); transformers
runs as it comes, and once more with the same allocator setting (`--allocator`).

    python benchmarks/train_step.py                                                   # CPU, tiny (issue 4's table)
    python benchmarks/train_step.py --device cuda --flavor small --tokens 8192 --seqlen 2048 --dtype bf16
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

# case -> (row name, layout)
CASES = {
    "hf": ("transformers DeepseekV3ForCausalLM (sdpa)", "[B,S] rows"),
    "hf-tuned": ("transformers DeepseekV3ForCausalLM (sdpa), glibc malloc tuned as anyseek does", "[B,S] rows"),
    "hf-eager": ("transformers DeepseekV3ForCausalLM (eager)", "[B,S] rows"),
    "rows": ("anyseek, MTP off", "[B,S] rows"),
    "packed": ("anyseek, MTP off, packed documents", "packed varlen"),
    "mtp": ("anyseek, MTP on, packed documents (as trained)", "packed varlen"),
}


def batches(data_dir: Path, tokens: int, seqlen: int, n: int):
    from anyseek.data.loader import PackedLoader

    loader = iter(PackedLoader(data_dir, split="train", tokens_per_batch=tokens, max_seqlen=seqlen, seed=0))
    out = []
    while len(out) < n:
        b = next(loader)
        if b.input_ids.numel() == tokens:
            out.append(b)
    return out


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def make_step(model, forward):
    fused = next(model.parameters()).device.type == "cuda"
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1,
                            **({"fused": True} if fused else {"foreach": True}))

    def step(b):
        loss = forward(b)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def build_case(case: str, ckpt: Path, cfg, rows_shape, dtype):
    """(model, forward) for one case; the weights come from the shared checkpoint (MTP's are fresh: the checkpoint
    has none)."""
    from anyseek.hf import load_pretrained
    from anyseek.model.transformer import DeepSeekV3

    if case.startswith("hf"):
        import transformers

        impl = "eager" if case == "hf-eager" else "sdpa"
        model = transformers.AutoModelForCausalLM.from_pretrained(str(ckpt), attn_implementation=impl,
                                                                  dtype=torch.float32)
        forward = lambda b: model(input_ids=b.input_ids.view(rows_shape), labels=b.input_ids.view(rows_shape)).loss
    elif case == "rows":
        model = load_pretrained(ckpt)
        forward = lambda b: model(b.input_ids.view(rows_shape), targets=b.targets.view(rows_shape),
                                  return_logits=False).loss
    else:
        model = load_pretrained(ckpt) if case == "packed" else DeepSeekV3(cfg)
        if case == "mtp":
            model.load_state_dict(load_pretrained(ckpt).state_dict(), strict=False)  # trunk as the others
        forward = lambda b: model(b.input_ids, cu_seqlens=b.cu_seqlens, targets=b.targets,
                                  max_seqlen=b.max_seqlen, return_logits=False).loss
    return model.to(dtype=dtype).train(), forward


def worker(args) -> None:
    """One case, one process: warm-up then timed steps; prints one JSON line of step times (seconds)."""
    torch.set_num_threads(args.threads)
    if args.tuned:
        from anyseek.runtime import tune_cpu_allocator

        tune_cpu_allocator()
    torch.manual_seed(0)
    from anyseek.hf import config_from_hf

    spec = json.loads(args.worker)
    cfg = config_from_hf(spec["config"])
    data = batches(Path(spec["data"]), args.tokens, args.seqlen, spec["first"] + args.steps)[spec["first"]:]
    warm = batches(Path(spec["data"]), args.tokens, args.seqlen, args.warmup)
    model, forward = build_case(spec["case"], Path(spec["ckpt"]), cfg, (args.tokens // args.seqlen, args.seqlen),
                                torch.float32)
    step = make_step(model, forward)
    for b in warm:
        step(b)
    times = []
    for b in data:
        t0 = time.perf_counter()
        step(b)
        times.append(time.perf_counter() - t0)
    print("RESULT " + json.dumps(times), flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--flavor", default="tiny")
    p.add_argument("--data", default=None, help="prepared data folder (default: the built-in sample)")
    p.add_argument("--tokens", type=int, default=4096, help="tokens per step")
    p.add_argument("--seqlen", type=int, default=512, help="row length for the [B, S] layout / max document segment")
    p.add_argument("--steps", type=int, default=24, help="timed steps per case (CPU: in all rounds together)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"], help="GPU: parameter dtype of both models")
    p.add_argument("--vocab", type=int, default=4096, help="BPE size when preparing the built-in sample")
    p.add_argument("--skip-eager", action="store_true")
    p.add_argument("--rounds", type=int, default=4, help="CPU: rounds of one fresh process per case")
    p.add_argument("--allocator", default="as-shipped", choices=["as-shipped", "default", "tuned"],
                   help="CPU: as-shipped = anyseek tuned as `anyseek train` does, transformers both ways; default = "
                        "nothing tuned; tuned = everything tuned")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--tuned", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        return worker(args)
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    torch.manual_seed(0)

    import transformers

    from anyseek.data.prepare import ensure_prepared
    from anyseek.data.shards import read_manifest
    from anyseek.hf import config_to_hf, save_pretrained
    from anyseek.model.config import ModelConfig
    from anyseek.model.transformer import DeepSeekV3

    data_dir = Path(args.data) if args.data else ensure_prepared("wiki-sample", vocab_size=args.vocab)
    vocab = read_manifest(data_dir)["vocab_size"]
    cfg = dataclasses.replace(ModelConfig.from_name(args.flavor), vocab_size=vocab)
    cfg_nomtp = dataclasses.replace(cfg, num_nextn_predict_layers=0)
    rows_shape = (args.tokens // args.seqlen, args.seqlen)
    results = []

    def record(case, times, mem, tuned=None):
        name, layout = CASES[case]
        med = statistics.median(times)
        results.append((case, name, layout, med * 1e3, args.tokens / med, mem, tuned))
        print(f"  {name:78s} {med * 1e3:8.1f} ms/step {args.tokens / med:10,.0f} tok/s", flush=True)

    cases = ["hf"] + ([] if args.skip_eager else ["hf-eager"]) + ["rows", "packed", "mtp"]
    with tempfile.TemporaryDirectory() as tmp:
        base = DeepSeekV3(cfg_nomtp)
        ckpt = Path(tmp) / "ckpt"
        save_pretrained(base, ckpt)
        if device.type == "cpu":
            plan = []  # (case, allocator tuned)
            for case in cases:
                anyseek_case = not case.startswith("hf")
                if args.allocator == "as-shipped":
                    plan.append((case, anyseek_case))
                    if case == "hf":
                        plan.append(("hf-tuned", True))
                else:
                    plan.append((case, args.allocator == "tuned"))
            times = {c: [] for c, _ in plan}
            per_round = max(1, args.steps // args.rounds)
            for r in range(args.rounds):
                for case, tuned in plan:
                    spec = {"case": case, "ckpt": str(ckpt), "data": str(data_dir),
                            "config": config_to_hf(cfg), "first": r * per_round}
                    cmd = [sys.executable, __file__, "--worker", json.dumps(spec), "--steps", str(per_round),
                           "--warmup", str(args.warmup), "--tokens", str(args.tokens), "--seqlen", str(args.seqlen),
                           "--threads", str(args.threads)] + (["--tuned"] if tuned else [])
                    out = subprocess.run(cmd, capture_output=True, text=True, check=False)
                    line = [x for x in out.stdout.splitlines() if x.startswith("RESULT ")]
                    if out.returncode != 0 or not line:
                        raise SystemExit(f"case {case} failed:\n{out.stdout[-2000:]}\n{out.stderr[-4000:]}")
                    times[case] += json.loads(line[0][len("RESULT "):])
                print(f"round {r + 1}/{args.rounds}: " + ", ".join(
                    f"{c} {statistics.median(t) * 1e3:.0f} ms" for c, t in times.items()), flush=True)
            for case, tuned in plan:
                record(case, times[case], float("nan"), tuned)
        else:
            data = batches(data_dir, args.tokens, args.seqlen, args.steps + args.warmup)
            for case in cases:
                model, forward = build_case(case, ckpt, cfg, rows_shape, dtype)
                model.to(device)
                torch.cuda.reset_peak_memory_stats(device)
                step = make_step(model, forward)
                t = []
                for i, b in enumerate(data):
                    b = b.to(device)
                    _sync(device)
                    t0 = time.perf_counter()
                    step(b)
                    _sync(device)
                    if i >= args.warmup:
                        t.append(time.perf_counter() - t0)
                record(case, t, torch.cuda.max_memory_allocated(device) / 2**30)
                model.to("cpu")

    ref = {r[0]: r[4] for r in results}  # case -> tokens/s
    hf_plain = ref.get("hf")
    hf_tuned = ref.get("hf-tuned")
    print()
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU, {args.threads} threads"
    print(f"Training step, {args.flavor} flavor ({base.num_parameters() / 1e6:.2f}M parameters), {args.tokens} "
          f"tokens/step, {args.dtype} parameters, {where}")
    method = (f"each case in a fresh process per round, {args.rounds} rounds, allocator {args.allocator}"
              if device.type == "cpu" else "cases one after another in one process")
    print(f"{platform.machine()}, torch {torch.__version__}, transformers {transformers.__version__}, "
          f"{time.strftime('%Y-%m-%d')}, median of {args.steps} steps after {args.warmup} warm-up, {method}")
    print()
    tuned_col = hf_tuned is not None
    print("| path | layout | malloc | ms/step | tokens/s | vs transformers |" + (" vs transformers, malloc tuned |"
                                                                              if tuned_col else " peak GiB |"))
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for case, name, layout, ms, tps, mem, tuned in results:
        malloc = "-" if tuned is None else ("tuned" if tuned else "default")
        last = f" {tps / hf_tuned:.2f}x |" if tuned_col else f" {mem:.1f} |"
        print(f"| {name} | {layout} | {malloc} | {ms:.1f} | {tps:,.0f} | {tps / hf_plain:.2f}x |{last}")


if __name__ == "__main__":
    main()
