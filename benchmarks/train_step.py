"""Training throughput: anyseek vs Hugging Face transformers' DeepseekV3ForCausalLM, on CPU or one GPU.

Same model config (`--flavor`, default tiny), same weights (copied through a saved checkpoint), same batches (the built-in
Wikipedia sample), same optimizer (AdamW, foreach), same thread count, same run. One step = forward + backward +
clip + AdamW step. transformers has no multi-token prediction and no packed-document masking, so the like-for-like rows
run anyseek with MTP off on the same [B, S] rows; the rows after show anyseek as it really trains (packed documents,
MTP on).

    python benchmarks/train_step.py --threads 2 --steps 20                       # CPU, tiny (issue 4's table)
    python benchmarks/train_step.py --device cuda --flavor small --tokens 8192 --seqlen 2048 --dtype bf16
"""

from __future__ import annotations

import argparse
import dataclasses
import platform
import statistics
import tempfile
import time
from pathlib import Path

import torch


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


def time_steps(step_fn, data, warmup: int, device: torch.device) -> list[float]:
    times = []
    for i, b in enumerate(data):
        b = b.to(device)
        _sync(device)
        t0 = time.perf_counter()
        step_fn(b)
        _sync(device)
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    return times


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


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--flavor", default="tiny")
    p.add_argument("--data", default=None, help="prepared data folder (default: the built-in sample)")
    p.add_argument("--tokens", type=int, default=4096, help="tokens per step")
    p.add_argument("--seqlen", type=int, default=512, help="row length for the [B, S] layout / max document segment")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"], help="parameter dtype of both models")
    p.add_argument("--vocab", type=int, default=4096, help="BPE size when preparing the built-in sample")
    p.add_argument("--skip-eager", action="store_true")
    p.add_argument("--rounds", type=int, default=0,
                   help="CPU: let the cases take turns in N rounds (robust to load bursts on a shared machine; every "
                        "case measured this way ran 10-40%% slower than alone). 0: each case alone, one after another")
    p.add_argument("--tune-allocator", action="store_true",
                   help="CPU: glibc malloc keeps large blocks on its heap (anyseek.runtime.tune_cpu_allocator, what "
                        "`anyseek train` does on CPU), for every case of this process, transformers' included")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    if args.tune_allocator:
        from anyseek.runtime import tune_cpu_allocator

        print(tune_cpu_allocator())
    device = torch.device(args.device)
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    torch.manual_seed(0)

    import transformers

    from anyseek.data.prepare import ensure_prepared
    from anyseek.data.shards import read_manifest
    from anyseek.model.config import ModelConfig
    from anyseek.model.transformer import DeepSeekV3

    data_dir = Path(args.data) if args.data else ensure_prepared("wiki-sample", vocab_size=args.vocab)
    vocab = read_manifest(data_dir)["vocab_size"]
    cfg = dataclasses.replace(ModelConfig.from_name(args.flavor), vocab_size=vocab)
    cfg_nomtp = dataclasses.replace(cfg, num_nextn_predict_layers=0)
    data = batches(data_dir, args.tokens, args.seqlen, args.steps + args.warmup)
    rows_shape = (args.tokens // args.seqlen, args.seqlen)

    def ours_rows(model):
        return lambda b: model(b.input_ids.view(rows_shape), targets=b.targets.view(rows_shape),
                               return_logits=False).loss

    def ours_packed(model):
        return lambda b: model(b.input_ids, cu_seqlens=b.cu_seqlens, targets=b.targets, max_seqlen=b.max_seqlen,
                               return_logits=False).loss

    results = []

    def record(name, layout, times, mem):
        med = statistics.median(times)
        results.append((name, layout, med * 1e3, args.tokens / med, mem))
        print(f"  {name:48s} {med * 1e3:8.1f} ms/step {args.tokens / med:10,.0f} tok/s", flush=True)

    def bench(name, model, forward, layout):  # one case at a time (GPU: per-case peak memory)
        model.to(device=device, dtype=dtype).train()
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        times = time_steps(make_step(model, forward), data, args.warmup, device)
        mem = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else float("nan")
        record(name, layout, times, mem)
        model.to("cpu")

    def bench_rounds(cases, rounds: int):
        """CPU: the cases take turns in rounds of (warm-up + steps/rounds timed) steps, so a busy moment on a shared
        machine hits every row alike, while each case still runs warm (back-to-back steps of one model)."""
        steps = [make_step(model.to(dtype=dtype).train(), forward) for _, model, forward, _ in cases]
        times = [[] for _ in cases]
        per_round = max(1, args.steps // rounds)
        for r in range(rounds):
            chunk = data[r * per_round: (r + 1) * per_round]
            for step, t in zip(steps, times):
                for b in data[-args.warmup:]:  # warm-up batches, untimed, before every turn
                    step(b)
                for b in chunk:
                    t0 = time.perf_counter()
                    step(b)
                    t.append(time.perf_counter() - t0)
        for (name, _, _, layout), t in zip(cases, times):
            record(name, layout, t, float("nan"))

    with tempfile.TemporaryDirectory() as tmp:
        base = DeepSeekV3(cfg_nomtp)
        base.save_pretrained(Path(tmp) / "ckpt")
        cases = []
        for impl in ("sdpa",) if args.skip_eager else ("sdpa", "eager"):
            hf = transformers.AutoModelForCausalLM.from_pretrained(str(Path(tmp) / "ckpt"), attn_implementation=impl,
                                                                   dtype=torch.float32)
            cases.append((f"transformers DeepseekV3ForCausalLM ({impl})", hf,
                          lambda b, m=hf: m(input_ids=b.input_ids.view(rows_shape),
                                            labels=b.input_ids.view(rows_shape)).loss, "[B,S] rows"))
        ours = DeepSeekV3.from_pretrained(Path(tmp) / "ckpt")
        packed = DeepSeekV3.from_pretrained(Path(tmp) / "ckpt")
        full = DeepSeekV3(cfg)
        cases += [
            ("anyseek, MTP off", ours, ours_rows(ours), "[B,S] rows"),
            ("anyseek, MTP off, packed documents", packed, ours_packed(packed), "packed varlen"),
            ("anyseek, MTP on, packed documents (as trained)", full, ours_packed(full), "packed varlen"),
        ]
        if device.type == "cpu" and args.rounds > 0:
            bench_rounds(cases, args.rounds)
        else:
            for name, model, forward, layout in cases:
                bench(name, model, forward, layout)

    hf_best = max(r[3] for r in results if r[0].startswith("transformers"))
    print()
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU, {args.threads} threads"
    print(f"Training step, {args.flavor} flavor ({base.num_parameters() / 1e6:.2f}M parameters), {args.tokens} "
          f"tokens/step, {args.dtype} parameters, {where}")
    print(f"{platform.machine()}, torch {torch.__version__}, transformers {transformers.__version__}, "
          f"{time.strftime('%Y-%m-%d')}, median of {args.steps} steps after {args.warmup} warm-up"
          f"{f', cases taking turns in {args.rounds} rounds' if args.rounds else ''}")
    print()
    print("| path | layout | ms/step | tokens/s | vs best transformers | peak GiB |")
    print("| --- | --- | --- | --- | --- | --- |")
    for name, layout, ms, tps, mem in results:
        print(f"| {name} | {layout} | {ms:.1f} | {tps:,.0f} | {tps / hf_best:.2f}x | {mem:.1f} |")


if __name__ == "__main__":
    main()
