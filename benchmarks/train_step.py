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
from train_step_cases import gpu_case, worker  # (beside this script: its folder is sys.path[0])

# case -> (row name, layout)
CASES = {
    "hf": ("transformers DeepseekV3ForCausalLM (sdpa)", "[B,S] rows"),
    "hf-tuned": ("transformers DeepseekV3ForCausalLM (sdpa), glibc malloc tuned as anyseek does", "[B,S] rows"),
    "hf-eager": ("transformers DeepseekV3ForCausalLM (eager)", "[B,S] rows"),
    "rows": ("anyseek, MTP off", "[B,S] rows"),
    "packed": ("anyseek, MTP off, packed documents", "packed varlen"),
    "mtp": ("anyseek, MTP on, packed documents (as trained)", "packed varlen"),
    "trainer": ("`anyseek train` step as shipped (clip, bias update; GPU: fp32 master + bf16 working copy)",
                "packed varlen"),
    "trainer-eager": ("same step without CUDA graphs (train.cuda_graphs=false)", "packed varlen"),
    "trainer-autocast": ("same step, bf16 autocast over the fp32 weights (train.working_copy=false)", "packed varlen"),
    "trainer-fsdp": ("same step under torchrun, 1 rank: FSDP2 (fully_shard; bf16 shards, fp32 masters beside them), "
                     "graphed, overlapped", "packed varlen"),
    "trainer-fsdp-fp32shards": ("the torchrun step with fp32 shards cast to bf16 at each gather "
                                "(parallel.shard_dtype=fp32, as before stop 36)", "packed varlen"),
    "trainer-fsdp-torchadamw": ("the torchrun step with fp32 shards and torch's fused AdamW (as before stop 35) "
                                "instead of TensorAdamW", "packed varlen"),
    "trainer-fsdp-eager": ("the torchrun step without CUDA graphs (train.cuda_graphs=false)", "packed varlen"),
    "trainer-fsdp-keep": ("the torchrun step keeping the gathered weights from forward to backward "
                          "(parallel.reshard_after_forward=false: one gather per step, not two)", "packed varlen"),
    "trainer-fsdp-sync": ("the torchrun step with train.overlap_steps=false", "packed varlen"),
    "trainer-fsdp-overlap": ("the torchrun step with train.overlap_steps=true (step N+1 queued before N's loss is "
                             "read; the default since stop 31)", "packed varlen"),
    "trainer-compile": ("same step with train.compile=true", "packed varlen"),
    "trainer-lora": ("same step, LoRA rank 16 on every target (train.lora_rank=16; base frozen in bf16)",
                     "packed varlen"),
    "trainer-bf16m": ("same step, AdamW moments in bf16 (train.moments_dtype=bf16)", "packed varlen"),
    "trainer-sync": ("`anyseek train` step, one at a time (train.overlap_steps=false)", "packed varlen"),
    "trainer-lora-sync": ("LoRA step, one at a time (train.overlap_steps=false)", "packed varlen"),
    "trainer-lora-overlap": ("LoRA step with train.overlap_steps=true (fused AdamW in one process: off by default)",
                             "packed varlen"),
}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--flavor", default="tiny")
    p.add_argument("--data", default=None, help="prepared data folder (default: the built-in sample)")
    p.add_argument("--tokens", type=int, default=4096, help="tokens per step")
    p.add_argument("--seqlen", type=int, default=512, help="row length for the [B, S] layout / max document segment")
    p.add_argument("--steps", type=int, default=24, help="timed steps per case (CPU: in all rounds together)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--window", type=int, default=5, help="GPU: steps timed back to back between two syncs (1: a "
                   "sync around every step); the table gives the median over windows")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"], help="GPU: parameter dtype of both models")
    p.add_argument("--vocab", type=int, default=4096, help="BPE size when preparing the built-in sample")
    p.add_argument("--skip-eager", action="store_true")
    p.add_argument("--rounds", type=int, default=4, help="CPU: rounds of one fresh process per case")
    p.add_argument("--repeat", type=int, default=1, help="GPU: run the cases in turn this many times (the table: "
                   "medians over all; each round's ratios printed)")
    p.add_argument("--allocator", default="as-shipped", choices=["as-shipped", "default", "tuned"],
                   help="CPU: as-shipped = anyseek tuned as `anyseek train` does, transformers both ways; default = "
                        "nothing tuned; tuned = everything tuned")
    p.add_argument("--cases", default="", help="comma-separated cases to run (default: all for the device): "
                   + ", ".join(CASES))
    p.add_argument("--compile", action="store_true", help="trainer case: train.compile=true")
    p.add_argument("--profile", default="", help="GPU: folder for the trainer step's kernel table (printed too)")
    p.add_argument("--json", default="", help="write the results as JSON to this file")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--gpu-case", default=None, help=argparse.SUPPRESS)
    p.add_argument("--tuned", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        return worker(args)
    if args.gpu_case:
        return gpu_case(args)
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
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
    results = []

    def record(case, times, mem, tuned=None):
        name, layout = CASES[case]
        med = statistics.median(times)
        results.append((case, name, layout, med * 1e3, args.tokens / med, mem, tuned))
        print(f"  {name:78s} {med * 1e3:8.1f} ms/step {args.tokens / med:10,.0f} tok/s", flush=True)

    cases = ["hf"] + ([] if args.skip_eager else ["hf-eager"]) + ["rows", "packed", "mtp"]
    if device.type == "cuda":
        cases.append("trainer")
    if args.cases:
        cases = [c for c in args.cases.split(",") if c]
        unknown = [c for c in cases if c not in CASES]
        if unknown:  # before any case runs (a name missing here used to fail only when its row was printed)
            raise SystemExit(f"--cases: unknown {', '.join(unknown)}; known: {', '.join(CASES)}")
    extra = {}  # case -> (mfu, launches per step, {category: ms})
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
            # each case in a fresh process: no case inherits another's allocator state or a profiler's hooks;
            # --repeat R: the cases take turns R times (the peer's speed follows the host, which drifts)
            gathered, mems = {c: [] for c in cases}, {}
            for rnd in range(args.repeat):
                this = {}
                for case in cases:
                    spec = {"case": case, "ckpt": str(ckpt), "data": str(data_dir), "config": config_to_hf(cfg),
                            "tmp": tmp}
                    cmd = [sys.executable, __file__, "--gpu-case", json.dumps(spec)] + sys.argv[1:]
                    out = subprocess.run(cmd, capture_output=True, text=True, check=False)
                    line = [x for x in out.stdout.splitlines() if x.startswith("RESULT ")]
                    if out.returncode != 0 or not line:
                        raise SystemExit(f"case {case} failed:\n{out.stdout[-2000:]}\n{out.stderr[-4000:]}")
                    r = json.loads(line[0][len("RESULT "):])
                    for x in out.stdout.splitlines():
                        if "mean loss of the first" in x or "CUDA graphs" in x:
                            print(x, flush=True)
                    if args.profile and rnd == args.repeat - 1:
                        print(r["table"])
                    extra[case] = (r["mfu"], r["launches"], r["cats"])
                    gathered[case] += r["times"]
                    mems[case] = max(mems.get(case, 0.0), r["mem"])
                    this[case] = statistics.median(r["times"]) * 1e3
                    # each case's numbers as soon as it ends (the table comes at the end; a timeout keeps these)
                    print(f"done {case}: {this[case]:.1f} ms/step, {args.tokens / this[case] * 1e3:,.0f} tokens/s, "
                          f"MFU {r['mfu']:.1%}, peak {r['mem']:.1f} GiB", flush=True)
                if args.repeat > 1:
                    ratios = [f"{c} {this['hf'] / ms:.2f}x" for c, ms in this.items() if c != "hf" and "hf" in this]
                    print(f"round {rnd + 1}/{args.repeat}: " + ", ".join(f"{c} {ms:.1f} ms" for c, ms in this.items())
                          + (f" (vs transformers in this round: {', '.join(ratios)})" if ratios else ""), flush=True)
            for case in cases:
                record(case, gathered[case], mems[case])

    ref = {r[0]: r[4] for r in results}  # case -> tokens/s
    hf_plain = ref.get("hf")
    hf_tuned = ref.get("hf-tuned")
    print()
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU, {args.threads} threads"
    print(f"Training step, {args.flavor} flavor ({base.num_parameters() / 1e6:.2f}M parameters), {args.tokens} "
          f"tokens/step, {args.dtype} parameters, {where}")
    method = (f"each case in a fresh process per round, {args.rounds} rounds, allocator {args.allocator}"
              if device.type == "cpu" else (f"each case in a fresh process, steps back to back in windows of "
                                            f"{args.window} (median window), profiled after its timed steps"))
    print(f"{platform.machine()}, torch {torch.__version__}, transformers {transformers.__version__}, "
          f"{time.strftime('%Y-%m-%d')}, median of {args.steps} steps after {args.warmup} warm-up, {method}")
    print()
    if device.type == "cuda":
        print("MFU = training FLOPs (6 x active parameters + causal attention over real document lengths, "
              "model.flops_per_token) / time / dense bf16 peak (train.metrics.peak_flops)")
        print()
        print("| path | layout | ms/step | tokens/s | vs transformers | MFU | host launches / GPU kernels per step "
              "| peak GiB |")
        print("| --- | --- | --- | --- | --- | --- | --- | --- |")
        for case, name, layout, ms, tps, mem, _ in results:
            mfu, (host, kernels), _ = extra.get(case, (float("nan"), (0, 0), {}))
            vs = f"{tps / hf_plain:.2f}x" if hf_plain else "-"
            print(f"| {name} | {layout} | {ms:.1f} | {tps:,.0f} | {vs} | {mfu:.1%} | {host} / {kernels} | {mem:.1f} |")
        print()
        for case, (_, _, cats) in extra.items():
            print(f"{case}: GPU ms/step by kernel category: " + ", ".join(f"{k} {v:.1f}" for k, v in cats.items()))
        if args.json:
            Path(args.json).write_text(json.dumps({"device": where, "torch": torch.__version__,
                                                   "transformers": transformers.__version__, "tokens": args.tokens,
                                                   "results": results, "extra": extra}, indent=1))
        return
    tuned_col = hf_tuned is not None
    print("| path | layout | malloc | ms/step | tokens/s | vs transformers |" + (" vs transformers, malloc tuned |"
                                                                              if tuned_col else " peak GiB |"))
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for case, name, layout, ms, tps, mem, tuned in results:
        malloc = "-" if tuned is None else ("tuned" if tuned else "default")
        last = f" {tps / hf_tuned:.2f}x |" if tuned_col else f" {mem:.1f} |"
        vs = f"{tps / hf_plain:.2f}x" if hf_plain else "-"
        print(f"| {name} | {layout} | {malloc} | {ms:.1f} | {tps:,.0f} | {vs} |{last}")


if __name__ == "__main__":
    main()
